"""Attention layout: time and peak memory of one drafter training step (forward + backward)
with the block-sparse layout computed three ways, at context 1k/2k/4k and 64-512 anchors:

- ``blockwise``: the CPU training path — context scores [Q, S] + per-block scores, one forward;
- ``dense``: one forward with a dense boolean mask over the whole layout [Q, S + Q] (SDPA);
- ``per_block``: one forward per anchor block with its visible context (the naive loop);
- ``flex`` (GPU only, compiled, bf16): the block-sparse flex_attention path.

Each case runs in a fresh subprocess so its peak RSS (CPU) / max allocated (GPU) is its own.

    python bench/attention_layout.py [--contexts 1024 2048 4096] [--anchors 64 256 512]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from common import fmt_table, peaks, write_result

from dflash_lit import DFlashConfig, DFlashDrafter
from dflash_lit.model.block_forward import draft_hidden
from dflash_lit.model.layout import build_layout
from dflash_lit.model.reference import reference_draft_hidden

D, BS, K = 256, 16, 4  # the tiny default drafter: hidden 256, Bs 16, 4 context layers


def setup(s: int, n: int, device: str, dtype: torch.dtype):
    cfg = DFlashConfig(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       intermediate_size=768, num_hidden_layers=1, block_size=BS, mask_token_id=1,
                       num_target_layers=8, target_layer_ids=[1, 2, 4, 5], vocab_size=4096)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to(device, dtype)
    embed = torch.nn.Embedding(4096, D).to(device, dtype).requires_grad_(False)
    ids = torch.randint(4, 4096, (1, s), device=device)
    lm = torch.ones(1, s, dtype=torch.long, device=device)
    lm[:, : s // 8] = 0  # a prompt: anchors come from the completion
    g = torch.Generator().manual_seed(0)
    cand = torch.arange(s // 8, s - BS)
    anchors = cand[torch.randperm(len(cand), generator=g)[:n]].sort().values[None].to(device)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    layout = build_layout(ids, lm, anchors, valid, BS, 1)
    th = torch.randn(1, s, K * D, device=device, dtype=dtype)
    return drafter, embed, th, layout


def step(method: str, drafter, embed, th, layout) -> None:
    drafter.zero_grad(set_to_none=True)
    if method == "per_block":
        h = reference_draft_hidden(drafter, embed, th, layout)
    else:
        h = draft_hidden(drafter, embed, th, layout, backend=method,
                         compile_mask=method == "flex")
    (h.float() ** 2).mean().backward()


def run_case(method: str, s: int, n: int, repeats: int) -> dict:
    dev = "cuda" if method == "flex" or (torch.cuda.is_available()) else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    drafter, embed, th, layout = setup(s, n, dev, dtype)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(method, drafter, embed, th, layout)  # warm-up (and compile for flex)
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(method, drafter, embed, th, layout)
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if dev == "cuda":
        mem = torch.cuda.max_memory_allocated() / 2**20
    else:  # KiB on Linux; the step's own growth over the set-up
        mem = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
    return {"method": method, "context": s, "anchors": n, "device": dev,
            "step_s": sorted(times)[len(times) // 2], "peak_mem_mib": mem}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--anchors", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case", nargs=3, metavar=("METHOD", "S", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        m, s, n = args.case
        print(json.dumps(run_case(m, int(s), int(n), args.repeats)))
        return
    methods = args.methods or (["blockwise", "dense", "per_block"]
                               + (["flex"] if torch.cuda.is_available() else []))
    rows = []
    for s in args.contexts:
        for n in args.anchors:
            if n * BS > s * 8 or n > s - s // 8 - BS:
                continue
            base = None
            for m in methods:
                reps = 1 if m == "per_block" else args.repeats
                out = subprocess.run([sys.executable, __file__, "--case", m, str(s), str(n),
                                      "--repeats", str(reps)], capture_output=True, text=True)
                if out.returncode != 0:
                    err = out.stderr.strip().splitlines()[-1] if out.stderr else "failed"
                    rows.append({"method": m, "context": s, "anchors": n, "error": err})
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                base = base or r
                r["time_vs_blockwise"] = r["step_s"] / base["step_s"]
                r["mem_vs_blockwise"] = r["peak_mem_mib"] / max(base["peak_mem_mib"], 1e-9)
                rows.append(r)
                print(r, flush=True)
    table = fmt_table(rows, ["method", "context", "anchors", "device", "step_s", "peak_mem_mib",
                             "time_vs_blockwise", "mem_vs_blockwise"])
    write_result("attention_layout", {"peaks": peaks(), "rows": rows}, table)


if __name__ == "__main__":
    main()
