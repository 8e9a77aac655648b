"""One-shot GPU check, run once on one GPU (H100/H200): sized to finish in under 8 minutes
(``--quick``: less); each part's seconds are in the result.

1. attention: ``attention.attend``'s flex path (compiled ``flex_attention`` on CUDA) with the
   training layout's flex BlockMask against the dense bool-mask SDPA path (the baseline) and
   eager flex (what training ran before flex was compiled), bf16 forward + backward on B=1, 3072 context tokens, 512 anchors x Bs=16,
   Qwen3-0.6B heads (16 q / 8 kv, head_dim 128). Outputs and input grads are compared with an
   fp32 dense reference: a flex path passes when its max error (relative to max |reference|)
   is <= 2x the dense bf16 path's own error + 2^-8 (half a bf16 ulp at that max), per tensor.
2. step: drafter training steps (target forward, drafter forward + fused hard CE, backward,
   AdamW) through the real module (``build_run``) under bf16 autocast, for a random
   Qwen3-0.6B-sized target (hidden 1024, 28 layers, vocab 151936) and 1 / 5 drafter layers at
   512 anchors x 3072 tokens: step time, tokens/s, MFU (bench/flops.py counts over a bf16
   matmul peak measured in this run), peak ``torch.cuda.max_memory_allocated``; dense
   attention is the baseline, compiled flex (``attention=auto``) the training default, eager
   flex the uncompiled alternative.
3. resume: ``train.py trainer=gpu`` subprocesses on a tiny random target: 20 steps straight vs
   10 steps (cut by the preemption path: SIGTERM -> last.ckpt, schedules still sized for 20)
   resumed with ``ckpt_path=last`` for 10 more. Checkpoints compared leaf by leaf; a second
   straight run alongside the resume measures the GPU's run-to-run nondeterminism: a resume
   that is not bit-exact passes if its weight difference is <= 2x that floor.

Writes ``<out>/gpu_check.{json,md}``; exits 1 when a check fails, 2 without CUDA.

    python bench/gpu_check.py [--quick] [--skip-step] [--skip-train] [--layers 1 5] [--out DIR]
                              [--device cuda:0]
    python bench/gpu_check.py --dry-run --quick --skip-train   # CPU plumbing check, tiny shapes
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from common import REPO, RESULTS, compose_train, fmt_table, matmul_peak, median_time, write_result

BF16_HALF_ULP = 2.0**-8
TOLERANCE = "per tensor: err <= 2 x dense bf16 err + 2^-8 (err = max|x - fp32 ref| / max|ref|)"


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Attention / step shapes: the training layout, the drafter's heads and the target."""

    context: int
    anchors: int
    block: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    steps: int
    warmup: int
    repeats: int


FULL = Shapes(3072, 512, 16, 16, 8, 128, 1024, 28, 3072, 151936, steps=5, warmup=2, repeats=5)
QUICK = dataclasses.replace(FULL, context=1024, anchors=128, steps=3, repeats=3)
DRY = Shapes(96, 8, 4, 4, 2, 16, 64, 8, 128, 512, steps=1, warmup=1, repeats=1)
MASK_ID = 3  # dflash_lit.tiny.random_targets reserves 0..3 (pad, bos, eos, mask)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (scale-free, in fp32)."""
    return float((x.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


# ------------------------------------------------------------------ 1. attention
def training_layout(sh: Shapes, dev: torch.device):
    """B=1 training layout: ``sh.anchors`` anchors sampled as in training (prompt = 1/16)."""
    from dflash_lit.model.layout import build_layout
    from dflash_lit.train.anchors import sample_anchors, step_generator

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, sh.vocab, (1, sh.context), generator=g).to(dev)
    lm = torch.ones_like(ids)
    lm[:, : sh.context // 16] = 0
    anchors, valid = sample_anchors(lm, sh.anchors, step_generator(0, 0, 0, "gpu_check"))
    return build_layout(ids, lm, anchors, valid, sh.block, MASK_ID)


def fwd_bwd(fn: Callable, qkv: list[torch.Tensor], do: torch.Tensor, backward: bool):
    """(output, input grads or None) of ``fn(q, k, v)``."""
    qkv = [t.detach().requires_grad_(backward) for t in qkv]
    out = fn(*qkv)
    return out.detach(), (torch.autograd.grad(out, qkv, do) if backward else None)


def attention_check(sh: Shapes, dev: torch.device) -> dict[str, Any]:
    """Dense SDPA vs eager / compiled flex: rows, ``ok`` (every flex path within tolerance)."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash_lit.model.attention import attend
    from dflash_lit.model.masks import dense_mask, flex_block_mask

    cuda = dev.type == "cuda"
    layout = training_layout(sh, dev)
    q_len = layout.num_blocks * sh.block
    kv_len = sh.context + q_len
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=g, dtype=torch.bfloat16)

    qkv = [rand(1, sh.heads, q_len, sh.head_dim), rand(1, sh.kv_heads, kv_len, sh.head_dim),
           rand(1, sh.kv_heads, kv_len, sh.head_dim)]
    do = rand(1, sh.heads, q_len, sh.head_dim)
    # mask builds per batch, as in training (flex: create_block_mask compiled on CUDA)
    mask_s = {"dense": median_time(lambda: dense_mask(layout), sh.repeats),
              "flex": median_time(lambda: flex_block_mask(layout, compile=cuda), sh.repeats)}
    dense = dense_mask(layout)
    block_mask = flex_block_mask(layout, compile=cuda)
    # on CPU (dry run) dynamo only: inductor's CPU flex takes ~25 s to build
    compiled = torch.compile(flex_attention, backend="inductor" if cuda else "eager")
    gqa = sh.heads != sh.kv_heads
    paths: dict[str, Callable] = {
        "dense SDPA (baseline)": lambda q, k, v: attend(q, k, v, dense),
        "flex eager": lambda q, k, v: flex_attention(
            q, k, v, block_mask=block_mask, enable_gqa=gqa),
        "flex compiled": lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa),
    }
    ref = fwd_bwd(paths["dense SDPA (baseline)"], [t.float() for t in qkv], do.float(), True)
    rows: list[dict] = []
    base: list[torch.Tensor] = []  # the dense bf16 path's out, dq, dk, dv
    ok = True
    for name, fn in paths.items():
        row: dict[str, Any] = {"path": name,
                               "mask_ms": 1e3 * mask_s["flex" if "flex" in name else "dense"]}
        backward = cuda or not base  # flex has no CPU backward
        try:
            out, grads = fwd_bwd(fn, qkv, do, backward)  # warm-up (and compile)
            row |= time_path(fn, qkv, do, backward, sh.repeats, dev)
        except Exception as e:  # a flex failure is this check's finding: record it, go on
            if not base:
                raise
            rows.append(row | {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
            ok = False
            continue
        mine = [out, *(grads or [])]
        base = base or mine
        for t_name, x, r, b in zip(("out", "dq", "dk", "dv"), mine, [ref[0], *ref[1]], base):
            row[f"{t_name}_err"] = err = rel_err(x, r)
            if x is not b:
                row[f"{t_name}_vs_dense"] = rel_err(x, b.float())
                ok &= err <= 2 * rel_err(b, r) + BF16_HALF_ULP
        if rows and "fwd_bwd_ms" in row:
            row["speedup_vs_dense"] = rows[0]["fwd_bwd_ms"] / row["fwd_bwd_ms"]
        rows.append(row)
        print(row, flush=True)
    note = "" if cuda else "flex backward skipped on CPU (not supported there); flex 'compiled' " \
                           "uses backend=eager on CPU"
    return {"rows": rows, "ok": ok, "note": note, "tolerance": TOLERANCE}


def time_path(fn: Callable, qkv: list[torch.Tensor], do: torch.Tensor, backward: bool,
              repeats: int, dev: torch.device) -> dict[str, float]:
    """Median forward (and forward + backward) ms of ``fn(q, k, v)``; CUDA: peak extra MiB."""
    ins = [t.detach().requires_grad_(backward) for t in qkv]
    out = {"fwd_ms": 1e3 * median_time(lambda: fn(*ins), repeats)}
    if not backward:
        return out
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    out["fwd_bwd_ms"] = 1e3 * median_time(lambda: torch.autograd.grad(fn(*ins), ins, do), repeats)
    if dev.type == "cuda":
        out["peak_mib"] = (torch.cuda.max_memory_allocated(dev) - before) / 2**20
    return out


# ------------------------------------------------------------------ 2. training step
def write_rows(out: Path, n: int, length: int, vocab: int, prompt: int, seed: int = 0) -> Path:
    """``n`` random-token shards rows of ``length`` tokens (the first ``prompt`` not trained)."""
    from dflash_lit.data.shards import write_shards

    g = torch.Generator().manual_seed(seed)
    rows = [{"id": f"row{i}", "source": "gpu_check",
             "input_ids": torch.randint(4, vocab, (length,), generator=g).tolist(),
             "loss_mask": [0] * prompt + [1] * (length - prompt)} for i in range(n)]
    write_shards(rows, out, rows_per_shard=8)
    return out


def step_overrides(sh: Shapes, layers: int, data: Path, cuda: bool) -> list[str]:
    """train.py overrides: v5 recipe, random Qwen3 target of ``sh``, one row of S per batch."""
    return [
        "experiment=v5_hardce", "budget=full", f"trainer={'gpu' if cuda else 'cpu'}",
        "target=random_qwen3", f"target.dtype={'bfloat16' if cuda else 'float32'}",
        f"target.build.vocab_size={sh.vocab}", f"target.build.hidden_size={sh.hidden}",
        f"target.build.num_layers={sh.layers}", f"+target.build.intermediate_size={sh.intermediate}",
        f"+target.build.num_attention_heads={sh.heads}",
        f"+target.build.num_key_value_heads={sh.kv_heads}", f"+target.build.head_dim={sh.head_dim}",
        f"+target.build.max_position_embeddings={sh.context + sh.block}",
        f"data.path={data}", "data.val_path=null", f"data.max_length={sh.context}",
        f"data.token_budget={sh.context}", "data.num_buckets=1",
        f"drafter.num_hidden_layers={layers}", f"drafter.num_attention_heads={sh.heads}",
        f"drafter.num_key_value_heads={sh.kv_heads}", f"drafter.head_dim={sh.head_dim}",
        f"drafter.intermediate_size={sh.intermediate}", f"drafter.block_size={sh.block}",
        f"schedule.anchors.max={sh.anchors}",
    ]


@contextlib.contextmanager
def flex_compiled(compiled: bool) -> Iterator[None]:
    """``attention.attend``'s flex call compiled on CUDA (the training default) or eager."""
    from dflash_lit.model import attention

    orig = attention.COMPILE_FLEX_ON_CUDA
    attention.COMPILE_FLEX_ON_CUDA = compiled
    try:
        yield
    finally:
        attention.COMPILE_FLEX_ON_CUDA = orig


def run_steps(module, batches: list[dict], warmup: int, dev: torch.device) -> dict[str, Any]:
    """Medians over the steps after ``warmup``: step seconds, its split into the target forward
    and the drafter part (forward, backward, AdamW), tokens, analytic FLOPs; CUDA peak memory."""
    from flops import drafter_train_flops, target_forward_flops

    cuda = dev.type == "cuda"
    module.zero_grad(set_to_none=True)  # a failed variant may have left gradients behind
    opt = module.configure_optimizers()["optimizer"]
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    rows = []
    for i, batch in enumerate(batches):
        if cuda and i == warmup:
            torch.cuda.reset_peak_memory_stats(dev)
        t = [time.perf_counter()]
        with amp:
            out = module.target_features(batch)
            sync(dev)
            t.append(time.perf_counter())
            module.schedules_at(i)
            loss, layouts = 0.0, []
            for name, (layout, lo) in module.drafter_losses(batch, out, i).items():
                loss = loss + lo.loss
                layouts.append((module.specs[name].model, layout))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        t.append(time.perf_counter())
        if i >= warmup:  # counted after the timed step (the counts sync)
            am = batch["attention_mask"]
            rows.append({
                "step_s": t[-1] - t[0], "target_fwd_s": t[1] - t[0], "drafter_s": t[-1] - t[1],
                "target_tokens": float(am.sum()), "loss": float(loss.detach()),
                "block_tokens": float(sum(int(lay.valid.sum()) * lay.block_size
                                          for _, lay in layouts)),
                "drafter_flops": sum(drafter_train_flops(c, lay) for c, lay in layouts),
                "target_flops": target_forward_flops(module.target.model, am, module.need_logits)})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["attention"] = module.attention_backend(layout)
    if cuda:
        med["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return med


def step_check(sh: Shapes, dev: torch.device, layers: int, data: Path,
               peak_flops: float) -> list[dict]:
    """Rows for one drafter depth: dense (baseline), compiled flex (training default), eager flex."""
    from dflash_lit.train.run import build_run

    cuda = dev.type == "cuda"
    module, dm, _ = build_run(compose_train(step_overrides(sh, layers, data, cuda)))
    module.to(dev)
    module.target.to(dev)
    module.train()
    loader = itertools.cycle(dm.train_dataloader())
    batches = [{k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
               for b in itertools.islice(loader, sh.warmup + sh.steps)]
    variants = {"dense (baseline)": ("dense", True)}
    if cuda:  # flex has no CPU backward
        variants |= {"flex compiled (attention=auto)": ("auto", True),
                     "flex eager": ("flex", False)}
    rows: list[dict] = []
    for name, (attention, compiled) in variants.items():
        module.attention = attention
        row: dict[str, Any] = {"drafter_layers": layers, "variant": name}
        try:
            with flex_compiled(compiled):
                m = run_steps(module, batches, sh.warmup, dev)
        except Exception as e:  # OOM, a compile failure: recorded, the other variants still run
            if not cuda:
                raise
            m = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        if "error" in m:  # outside the except block: its frames (and tensors) are gone now
            rows.append(row | m)
            torch.cuda.empty_cache()
            continue
        flops = m["drafter_flops"] + m["target_flops"]
        row |= {"attention": m["attention"], "step_s": m["step_s"],
                "target_fwd_s": m["target_fwd_s"], "drafter_s": m["drafter_s"],
                "tok_s": m["target_tokens"] / m["step_s"],
                "block_tok_s": m["block_tokens"] / m["step_s"],
                "tflops": flops / m["step_s"] / 1e12, "mfu": flops / m["step_s"] / peak_flops,
                "drafter_mfu": m["drafter_flops"] / m["drafter_s"] / peak_flops,
                "peak_gib": m.get("peak_gib", ""), "loss": m["loss"]}
        if rows and "step_s" in rows[0]:
            row["speedup_vs_dense"] = rows[0]["step_s"] / m["step_s"]
        rows.append(row)
        print(row, flush=True)
    del module, batches
    if cuda:
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ 3. train.py resume
@functools.cache
def _sigterm_at() -> type:
    from lightning.pytorch.callbacks import Callback

    class SigtermAt(Callback):
        """train.py callback (``+callbacks.cut._target_=gpu_check.SigtermAt``): SIGTERM to this
        process at the start of batch ``step`` (0-based), so the project's PreemptionCheckpoint
        saves ``last.ckpt`` after that batch (global step ``step + 1``) and stops the run."""

        def __init__(self, step: int) -> None:
            self.step = step

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == self.step:
                os.kill(os.getpid(), signal.SIGTERM)

    return SigtermAt


def __getattr__(name: str) -> Any:
    """``gpu_check.SigtermAt`` built on first use: importing lightning costs seconds, which the
    no-CUDA exit should not pay."""
    if name == "SigtermAt":
        return _sigterm_at()
    raise AttributeError(name)


def launch(runs: dict[str, list[str]], work: Path, env: dict[str, str],
           timeout: float = 600) -> dict[str, dict[str, Any]]:
    """Run train.py once per entry, side by side (one GPU holds them all); per run the exit
    code, seconds until it was seen done and, on failure, the tail of its log."""
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        procs = {}
        for name, ov in runs.items():
            log = stack.enter_context(open(work / f"{name}.log", "w"))
            procs[name] = subprocess.Popen([sys.executable, str(REPO / "train.py"), *ov], cwd=work,
                                           env=env, stdout=log, stderr=subprocess.STDOUT)
        out: dict[str, dict[str, Any]] = {}
        for name, p in procs.items():
            try:
                rc = p.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            out[name] = {"rc": rc, "s": time.perf_counter() - t0}
    for name, r in out.items():
        if r["rc"]:
            r["tail"] = (work / f"{name}.log").read_text()[-3000:]
    return out


def train_env(dev: torch.device) -> dict[str, str]:
    """Subprocess env: this checkout's src/ and bench/ first, W&B off, the chosen GPU only."""
    path = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO / "bench"),
                                         os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, WANDB_MODE="disabled")
    if dev.type == "cuda" and dev.index is not None:
        visible = env.get("CUDA_VISIBLE_DEVICES", "").split(",")
        env["CUDA_VISIBLE_DEVICES"] = visible[dev.index] if visible[0] else str(dev.index)
    return env


def resume_check(dev: torch.device, work: Path, steps: int = 20) -> dict[str, Any]:
    """``steps`` straight vs half, then ``ckpt_path=last`` for the rest; a second straight run
    alongside the resume measures run-to-run nondeterminism (the tolerance if not bit-exact).
    Data and overrides are the training tests' (tests/train_utils.py), on ``trainer=gpu``."""
    from soak import compare_checkpoints

    sys.path.insert(0, str(REPO / "tests"))
    from train_utils import base_overrides, make_shards

    data = make_shards(work / "train", n=40), make_shards(work / "val", n=6, seed=1)
    ov = base_overrides(work, *data) + [f"trainer={'gpu' if dev.type == 'cuda' else 'cpu'}",
                                        "experiment=v5_hardce", f"trainer.max_steps={steps}"]
    env = train_env(dev)

    def run_dir(name: str) -> list[str]:
        return [*ov, f"hydra.run.dir={work / name}"]

    def last(name: str) -> Path:
        return work / name / "checkpoints" / "last.ckpt"

    runs = launch({"straight": run_dir("straight"),
                   "first_half": [*run_dir("resumed"), "+callbacks.cut._target_=gpu_check.SigtermAt",
                                  f"+callbacks.cut.step={steps // 2 - 1}"]}, work, env)
    cut = (torch.load(last("resumed"), map_location="cpu", weights_only=True)["global_step"]
           if last("resumed").is_file() else None)
    runs |= launch({"resume": [*run_dir("resumed"), "ckpt_path=last"],
                    "straight_again": run_dir("straight_again")}, work, env)
    out: dict[str, Any] = {"runs": runs, "cut_at_step": cut}
    if any(r["rc"] for r in runs.values()):
        return out | {"ok": False, "verdict": "a train.py run failed (see runs.*.tail)"}
    out["resumed_from"] = (work / "resumed" / "resumed_from.txt").read_text().strip()
    out["compare"] = cmp = compare_checkpoints(last("straight"), last("resumed"))
    out["run_to_run"] = floor = compare_checkpoints(last("straight"), last("straight_again"))
    det = "deterministic" if floor["identical"] else "nondeterministic"
    if cut != steps // 2 or cmp["global_step"] != [steps, steps]:
        return out | {"ok": False, "verdict": f"cut at step {cut}, final steps "
                                              f"{cmp['global_step']} (want {steps // 2}, {steps})"}
    if cmp["identical"]:
        return out | {"ok": True, "verdict": f"bit-exact (weights, Adam moments, LR, step); "
                                             f"two straight runs: {det}"}
    d, f = cmp["weights"]["max_abs_diff"], floor["weights"]["max_abs_diff"]
    ok = 0 < f and d <= 2 * f
    why = (f"weights differ by {d:.3g} max abs; two straight runs by {f:.3g} ({det} GPU "
           "kernels): tolerance 2x the straight-vs-straight difference")
    return out | {"ok": ok, "verdict": ("within" if ok else "beyond") + " run-to-run noise: " + why}


# ------------------------------------------------------------------ main
def with_tmp(fn: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """``fn(tmp)`` in a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        return fn(Path(tmp))


def step_part(sh: Shapes, dev: torch.device, layers: list[int], peak: float) -> dict[str, Any]:
    """Check 2 for each drafter depth; ``ok`` when no variant failed."""
    def run(tmp: Path) -> dict[str, Any]:
        data = write_rows(tmp / "rows", sh.warmup + sh.steps, sh.context, sh.vocab,
                          sh.context // 16)
        rows = [r for n in layers for r in step_check(sh, dev, n, data, peak)]
        return {"rows": rows, "ok": all("error" not in r for r in rows)}

    return with_tmp(run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1k context, 128 anchors, fewer repeats")
    ap.add_argument("--skip-train", action="store_true", help="skip check 3 (train.py runs)")
    ap.add_argument("--skip-step", action="store_true", help="skip check 2 (training steps)")
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 5], help="drafter depths (2)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    ap.add_argument("--device", default="cuda", help="CUDA device, e.g. cuda:1")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU needed: the same code paths on CPU at tiny shapes")
    args = ap.parse_args(argv)
    if args.dry_run:
        dev, sh = torch.device("cpu"), DRY
    else:
        dev = torch.device(args.device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            print(f"gpu_check: no CUDA device ({args.device!r}, torch {torch.__version__}); run it "
                  "on a GPU machine, or pass --dry-run for a CPU plumbing check", file=sys.stderr)
            return 2
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
        sh = QUICK if args.quick else FULL
    t_start = time.perf_counter()
    # MFU denominator: a matmul in the step's dtype (bf16 autocast on CUDA, fp32 on CPU)
    cuda = dev.type == "cuda"
    dtype, n = (torch.bfloat16, 8192) if cuda else (torch.float32, 256)
    peak = matmul_peak(dtype, n, repeats=10 if cuda else 2, device=str(dev)) * 1e9
    print(f"{dtype} matmul peak (n={n}): {peak / 1e12:.3g} TFLOP/s", flush=True)
    payload: dict[str, Any] = {"device": str(dev), "dry_run": args.dry_run, "quick": args.quick,
                               "shapes": dataclasses.asdict(sh),
                               "peak": {"dtype": str(dtype), "n": n, "tflops": peak / 1e12}}
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "attention": lambda: attention_check(sh, dev)}
    if not args.skip_step:
        parts["step"] = lambda: step_part(sh, dev, args.layers, peak)
    if not args.skip_train:
        parts["resume"] = lambda: with_tmp(lambda tmp: resume_check(dev, tmp))
    checks: dict[str, bool] = {}
    for name, fn in parts.items():  # a crash in one part is recorded; the others still run
        t0 = time.perf_counter()
        try:
            payload[name] = fn()
        except Exception as e:
            traceback.print_exc()
            payload[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
        payload[name]["s"] = time.perf_counter() - t0
        checks[name] = payload[name]["ok"]
        print(f"{name}: {'PASS' if checks[name] else 'FAIL'} in {payload[name]['s']:.0f} s",
              flush=True)
    payload |= {"checks": checks, "wall_s": time.perf_counter() - t_start}
    table, summary = report(payload, sh)
    write_result("gpu_check", payload, table, results=args.out)
    print("\n" + "\n".join(summary))
    return 0 if all(checks.values()) else 1


def report(payload: dict[str, Any], sh: Shapes) -> tuple[str, list[str]]:
    """(markdown tables, summary lines) of a ``main`` payload."""
    sections, summary = [], []
    for name, res in ((k, payload[k]) for k in payload["checks"]):
        verdict = "PASS" if res["ok"] else "FAIL"
        if "error" in res:  # the part crashed (traceback printed above)
            sections.append(f"### {name}\n\ncrashed: {res['error']}")
            summary.append(f"{name}: FAIL (crashed: {res['error'][:200]})")
        elif name == "attention":
            sections.append(
                f"### attention (bf16, S={sh.context}, {sh.anchors} anchors x {sh.block})\n\n"
                + fmt_table(res["rows"], ["path", "fwd_ms", "fwd_bwd_ms", "speedup_vs_dense",
                                          "peak_mib", "mask_ms", "out_err", "dq_err", "dk_err",
                                          "dv_err", "out_vs_dense", "dq_vs_dense", "error"])
                + f"\n\n{res['tolerance']}: {verdict}" + (f"; {res['note']}" if res["note"] else ""))
            comp = next((r for r in res["rows"] if r["path"] == "flex compiled"), {})
            errs = [comp[k] for k in ("out_err", "dq_err", "dk_err", "dv_err") if k in comp]
            detail = comp.get("error") or f"compiled flex max err {max(errs):.3g}"
            if "speedup_vs_dense" in comp:
                detail += f", fwd+bwd {comp['speedup_vs_dense']:.2f}x dense SDPA"
            summary.append(f"attention: {verdict} ({detail})")
        elif name == "step":
            sections.append(
                f"### training step ({sh.layers}-layer target d={sh.hidden}, V={sh.vocab}; "
                f"{sh.anchors} anchors x {sh.context} tokens)\n\n"
                + fmt_table(res["rows"], ["drafter_layers", "variant", "attention", "step_s",
                                          "speedup_vs_dense", "tok_s", "block_tok_s", "tflops",
                                          "mfu", "drafter_mfu", "peak_gib", "error"]))
            summary.append(f"step: {verdict} (" + "; ".join(
                f"{r['drafter_layers']}L {r['variant']}: " + (r["error"] if "error" in r else
                f"{r['step_s']:.3g} s, {r['tok_s']:.0f} tok/s, MFU {r['mfu']:.1%}")
                for r in res["rows"]) + ")")
        else:
            runs = [{"run": k, "rc": v["rc"], "done_after_s": v["s"]} for k, v in res["runs"].items()]
            sections.append("### train.py resume (20 steps)\n\n" + fmt_table(runs)
                            + f"\n\nresume: {verdict}, {res['verdict']}")
            summary.append(f"resume: {verdict} ({res['verdict']})")
    pk = payload["peak"]
    sections.append(f"matmul peak (same run, {pk['dtype']}, n={pk['n']}): {pk['tflops']:.3g} "
                    f"TFLOP/s; wall {payload['wall_s']:.0f} s")
    return "\n\n".join(sections), summary


if __name__ == "__main__":
    sys.exit(main())
