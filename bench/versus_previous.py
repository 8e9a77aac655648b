"""The default experiment's training step, this tree against an earlier revision, in one run.

The earlier revision (``--rev``, default ``0050b37``: main before the speed work: target run
per batch, logits materialised for every slot, dense-mask attention) is checked out into a
temporary git worktree and run with its own code and config; this tree runs the same
experiment with the same batch (``data.token_budget`` and the checkpoint cadence of the
earlier default; everything else is this tree's default: cached features, fused loss,
``attention=auto``, and the precision this machine resolves to; where that is bf16-mixed,
this tree also runs at fp32, so the code's gain and bf16's are told apart). Each side runs ``train.py`` twice, for ``--short`` and ``--long`` steps,
alternating sides, and the cost of a step is the difference of the wall times over the
difference of the steps, so start-up, model loading and the end-of-run work cancel out.

    python bench/versus_previous.py [--rev 0050b37] [--short 2] [--long 32]

The feature cache of this tree's run is built by a first, untimed run when it is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, fmt_table, peaks, write_result

from dflash_lit.precision import cpu_precision

# The earlier default's batch and checkpoint cadence, applied to this tree's run.
SAME_BATCH = ["data.token_budget=8192", "callbacks.model_checkpoint.every_n_train_steps=25"]


def run_train(root: Path, overrides: list[str], steps: int, out: Path) -> float:
    """Wall seconds of ``train.py`` in ``root`` (its own ``src`` first on the path)."""
    if out.exists():
        shutil.rmtree(out)
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "train.py", "experiment=v5_hardce", *overrides,
           f"trainer.max_steps={steps}", f"hydra.run.dir={out}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=root, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="0050b37", help="the earlier revision (git)")
    ap.add_argument("--short", type=int, default=2, help="steps of the short runs")
    ap.add_argument("--long", type=int, default=32, help="steps of the long runs")
    args = ap.parse_args()
    if args.long <= args.short:
        raise SystemExit(f"--long ({args.long}) must be larger than --short ({args.short})")
    known = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.rev}^{{commit}}"],
                           cwd=REPO, capture_output=True)
    if known.returncode != 0:
        raise SystemExit(f"--rev {args.rev}: no such commit in this clone (git log shows them)")
    tmp = Path(tempfile.mkdtemp(prefix="dflash_prev_"))
    prev = tmp / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(prev), args.rev], cwd=REPO,
                   check=True, capture_output=True)
    try:
        auto = cpu_precision()  # what this tree's default resolves to on this machine
        sides = {f"previous ({args.rev}, 32-true)": (prev, []),
                 f"this tree ({auto})": (REPO, SAME_BATCH)}
        if auto != "32-true":  # also fp32, to split the code's gain from bf16's
            sides["this tree (32-true)"] = (REPO, [*SAME_BATCH, "trainer.precision=32-true"])
        run_train(REPO, SAME_BATCH, 1, tmp / "warm")  # builds this tree's cache if missing
        wall: dict[str, dict[int, float]] = {name: {} for name in sides}
        for steps in (args.short, args.long):
            for name, (root, overrides) in sides.items():
                wall[name][steps] = run_train(root, overrides, steps, tmp / "run")
                print(name, steps, f"{wall[name][steps]:.1f}s", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(prev)], cwd=REPO,
                       check=False, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for name, w in wall.items():
        step_s = (w[args.long] - w[args.short]) / (args.long - args.short)
        rows.append({"code": name, f"wall_{args.short}_steps_s": w[args.short],
                     f"wall_{args.long}_steps_s": w[args.long], "step_s": step_s})
    base = rows[0]["step_s"]
    for r in rows:
        r["step_vs_previous"] = r["step_s"] / base
    pk = peaks()
    table = fmt_table(rows) + (
        f"\n\n`experiment=v5_hardce` with the earlier default's batch (data.token_budget=8192)"
        f" on both sides; step_s = wall-time difference / {args.long - args.short} steps; "
        f"matmul peaks (same run) fp32 {pk['fp32_gflops']:.1f}, bf16 {pk['bf16_gflops']:.1f} "
        f"GFLOP/s; this tree's precision is `trainer.precision=${{cpu_precision:}}` (bf16-mixed "
        f"where bf16 matmuls are >= 1.3x faster than fp32)")
    write_result("versus_previous", {"rev": args.rev, "rows": rows, "peaks": pk,
                                     "short": args.short, "long": args.long}, table)


if __name__ == "__main__":
    main()
