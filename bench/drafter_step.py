"""Drafter training step (layout + drafter forward + lm_head + loss + backward, no target
forward) at a realistic CPU size, the materialised path against the fused one, in one run.

Size (the issue's "realistic CPU size"): vocab 4096, hidden 256, B=4, S=512, Bs=16, a
1-layer drafter, 32 / 128 anchors per sequence; labels = the target's argmax, as in v5.

- ``materialised``: dense-mask SDPA, ``lm_head`` over every slot ([B, N, Bs, V]
  logits), the target's logits gathered per slot for the argmax labels, plain CE (what
  validation computes when it needs the logits);
- ``fused fp32``: same attention, ``fused_hard_ce`` (chunked lm_head + CE over valid slots,
  gradient formed in the forward), labels from the target's argmax ids [B, S];
- ``+ blockwise``: the fused loss with the blockwise attention (on CPU torch's fused flash
  kernel over the context, the block part merged by log-sum-exp; ``attention=auto`` on CPU);
- ``fused bf16 head`` (``+ bf16 autocast``): lm_head matmuls in bf16 (and the drafter body
  under CPU bf16 autocast) — run only where ``dflash_lit.precision`` measures bf16 faster;
  ``fused bf16 + blockwise`` is what the default trains with on such a CPU.

Also reports peak step memory (fresh subprocess per case, ru_maxrss growth) at 512 anchors,
and each step's model FLOP/s (``bench/flops.py``) over the fp32 matmul peak measured in the
same run: where the materialised path already runs near that peak, no kernel can make a step
much faster without doing less arithmetic.

    python bench/drafter_step.py [--anchors 32 128] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys

import torch
from common import drafter_step_parts, fmt_table, median_time, peaks, write_result
from flops import drafter_train_flops

from dflash_lit import DFlashConfig
from dflash_lit.model.block_forward import draft_hidden
from dflash_lit.model.layout import build_layout, gather_target_argmax, gather_target_logits
from dflash_lit.train.anchors import sample_anchors, step_generator
from dflash_lit.train.linear_ce import fused_hard_ce
from dflash_lit.train.losses import hard_ce_loss, resolve_argmax_labels, target_argmax_labels

V, D, B, S, BS, K = 4096, 256, 4, 512, 16, 4
VARIANTS = {
    "materialised": dict(fused=False, head=None, attn="dense", autocast=False),
    "fused fp32": dict(fused=True, head=None, attn="dense", autocast=False),
    "fused fp32 + blockwise": dict(fused=True, head=None, attn="blockwise", autocast=False),
}
# bf16 only where this CPU runs it faster (dflash_lit.precision): on AVX2-only CPUs bf16
# matmuls are ~50x slower than fp32 and the variants would take minutes per step.
BF16_VARIANTS = {
    "fused bf16 head": dict(fused=True, head=torch.bfloat16, attn="dense", autocast=False),
    "fused bf16 head + bf16 autocast": dict(fused=True, head=torch.bfloat16, attn="dense",
                                            autocast=True),
    # what the default trains with on such a CPU: bf16-mixed and attention=auto (blockwise)
    "fused bf16 + blockwise (default here)": dict(fused=True, head=torch.bfloat16,
                                                  attn="blockwise", autocast=True),
}


def setup(n_anchors: int):
    cfg = DFlashConfig(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       intermediate_size=768, num_hidden_layers=1, block_size=BS, mask_token_id=1,
                       num_target_layers=8, target_layer_ids=[1, 2, 4, 5], vocab_size=V)
    drafter, embed, lm_head, ids, lm, am = drafter_step_parts(cfg, B, S, S // 8, min_id=4)
    th = torch.randn(B, S, K * D)
    target_logits = torch.randn(B, S, V)
    anchors, valid = sample_anchors(lm, n_anchors, step_generator(0, 0, 0, "bench"), am)
    layout = build_layout(ids, lm, anchors, valid, BS, 1, am)
    return drafter, embed, lm_head, th, target_logits, layout


def make_step(variant: dict, drafter, embed, lm_head, th, target_logits, layout):
    argmax = target_logits.argmax(-1)  # the fused path gets argmax ids [B, S] (cache/online)

    def step() -> float:
        drafter.zero_grad(set_to_none=True)
        ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if variant["autocast"]
               else contextlib.nullcontext())
        with ctx:
            h = draft_hidden(drafter, embed, th, layout, backend=variant["attn"])
        if variant["fused"]:
            labels = resolve_argmax_labels(gather_target_argmax(argmax, layout), layout.labels)
            out, _ = fused_hard_ce(h.float(), lm_head.weight, labels, 7.0,
                                   compute_dtype=variant["head"])
        else:
            logits = lm_head(h)
            tl = gather_target_logits(target_logits, layout)
            out = hard_ce_loss(logits, target_argmax_labels(tl, layout.labels), 7.0)
            logits.argmax(-1)  # the training metrics' argmax over the full logits
        out.loss.backward()
        return float(out.loss)

    return step


def run_case(name: str, n: int, repeats: int) -> dict:
    parts = setup(n)
    step = make_step({**VARIANTS, **BF16_VARIANTS}[name], *parts)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loss = step()
    t = median_time(step, repeats=repeats, warmup=1)
    mem = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    gflop = drafter_train_flops(parts[0].config, parts[-1]) / 1e9  # the same for every variant
    return {"variant": name, "anchors": n, "step_s": t, "peak_mem_mib": mem, "loss": loss,
            "gflop": gflop}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--anchors", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--memory-anchors", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.repeats)))
        return
    from dflash_lit.precision import bf16_speedup

    variants = [*VARIANTS, *(BF16_VARIANTS if bf16_speedup() >= 1.3 else [])]
    rows = []
    for n in [*args.anchors, args.memory_anchors]:
        base = None
        for name in variants:
            out = subprocess.run([sys.executable, __file__, "--case", name, str(n), "--repeats",
                                  str(args.repeats), "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            base = base or r
            r["speedup_vs_materialised"] = base["step_s"] / r["step_s"]
            r["mem_vs_materialised"] = r["peak_mem_mib"] / max(base["peak_mem_mib"], 1e-9)
            rows.append(r)
            print(r, flush=True)
    pk = peaks()
    for r in rows:  # model FLOP/s over the fp32 matmul peak measured in this run
        r["mfu_fp32"] = r["gflop"] / r["step_s"] / pk["fp32_gflops"]
    table = fmt_table(rows, ["variant", "anchors", "step_s", "speedup_vs_materialised", "mfu_fp32",
                             "peak_mem_mib", "mem_vs_materialised", "loss"])
    table += (f"\n\nthreads {args.threads}; matmul peak (same run): fp32 {pk['fp32_gflops']:.1f}"
              f" GFLOP/s, bf16 {pk['bf16_gflops']:.1f} GFLOP/s")
    table += f"; bf16/fp32 speed measured by dflash_lit.precision: {bf16_speedup():.2f}x"
    write_result("drafter_step", {"peaks": pk, "threads": args.threads, "rows": rows,
                                  "bf16_speedup": bf16_speedup()}, table)


if __name__ == "__main__":
    main()
