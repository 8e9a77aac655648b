"""Real τ of one run's checkpoints against steps and target tokens, with a projection.

    python bench/tau_curve.py --run outputs/smollm2_long2 --every 1500 --prompts humaneval \\
        --limit 20 --eval-overrides target=smollm2 dtype=float32

Evaluates every ``--every``-th periodic checkpoint of a run (``checkpoints/step*.ckpt``, kept
with ``callbacks.model_checkpoint.save_top_k=-1``) by real speculative decoding
(``evaluate.py``, lossless checked; a report already written is read back), and writes
``bench/results/tau_curve_<name>.{json,md,png}``: τ per method against steps and target tokens,
and ``dflash_lit.analyze``'s projection of each τ to ``--project-to`` (the model chosen on
held-out points, its 10-90 % bootstrap band; none below its minimum number of points).

Read a curve of one cosine schedule for what it is: its late flattening is partly the
learning-rate decay, so its projection past the run's own last step is a lower bound for a
longer schedule, not a forecast of one.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from common import REPO, RESULTS, fmt_table, write_result

from dflash_lit.analyze.fits import MIN_POINTS, project
from dflash_lit.checkpoint import safe_load


def checkpoints(run: Path, every: int) -> list[tuple[int, Path]]:
    """(step, path) of the run's periodic checkpoints at multiples of ``every``, then last.ckpt."""
    out = []
    for p in sorted((run / "checkpoints").glob("step*.ckpt")):
        step = int(re.sub(r"\D", "", p.stem))
        if step % every == 0:
            out.append((step, p))
    last = run / "checkpoints" / "last.ckpt"
    if last.is_file():
        step = int(safe_load(last).get("global_step", 0))
        if not out or step > out[-1][0]:
            out.append((step, last))
    return out


def evaluate(ckpt: Path, out: Path, args) -> dict:
    if not (out / "report.json").is_file():
        cmd = [sys.executable, str(REPO / "evaluate.py"), f"ckpt={ckpt}",
               f"prompts={args.prompts}", f"limit={args.limit}",
               f"max_new_tokens={args.max_new_tokens}", f"methods={args.methods}",
               f"budgets=[{args.budget}]", "progress=false", "plot=false", f"out={out}",
               *args.eval_overrides]
        subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads((out / "report.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a training run directory")
    ap.add_argument("--every", type=int, default=1500, help="evaluate checkpoints at multiples of this step")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="[chain]", help="evaluate.py methods")
    ap.add_argument("--budget", type=int, default=16, help="DDTree node budget")
    ap.add_argument("--project-to", type=int, default=None, help="projection step (default 2x the last)")
    ap.add_argument("--name", default=None, help="result name (default: the run directory's name)")
    ap.add_argument("--eval-overrides", nargs="*", default=[])
    args = ap.parse_args()
    name = args.name or args.run.name
    work = REPO / "outputs" / "bench" / f"tau_curve_{name}"
    rows = []
    for step, ckpt in checkpoints(args.run, args.every):
        rep = evaluate(ckpt, work / f"step{step}", args)
        meta = safe_load(ckpt).get("dflash", {})
        row = {"step": step, "tokens": meta.get("tokens_seen"), "lossless": rep["lossless"]}
        row.update({k: v["tau"] for k, v in rep["methods"].items() if k != "baseline"})
        rows.append(row)
    if not rows:
        raise SystemExit(f"{args.run}: no checkpoints at multiples of {args.every}")
    methods = [k for k in rows[-1] if k not in ("step", "tokens", "lossless")]
    final = args.project_to or 2 * rows[-1]["step"]
    steps = torch.tensor([r["step"] for r in rows], dtype=torch.float64).numpy()
    projections = {}
    for m in methods:
        pr = project(steps, torch.tensor([r[m] for r in rows]).numpy(), final, metric=f"tau_{m}")
        projections[m] = {"value": pr.value, "lo": pr.lo, "hi": pr.hi, "note": pr.note,
                          "model": pr.chosen.name if pr.chosen else None}
    table = fmt_table(rows, ["step", "tokens", *methods, "lossless"])
    table += "\n\n" + fmt_table(
        [{"method": m, "projected_step": final, **p} for m, p in projections.items()],
        ["method", "projected_step", "value", "lo", "hi", "model", "note"])
    table += (f"\n\n{args.prompts}, first {args.limit} prompts x {args.max_new_tokens} tokens; "
              f"projection needs >= {MIN_POINTS} points; one cosine schedule's curve flattens "
              "with its learning rate, so past its last step the projection is a lower bound.\n")
    write_result(f"tau_curve_{name}", {"run": str(args.run.name), "rows": rows,
                                       "projections": projections}, table)
    _plot(rows, methods, projections, final, RESULTS / f"tau_curve_{name}.png")


def _plot(rows, methods, projections, final, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        ax.plot([r["step"] for r in rows], [r[m] for r in rows], "o-", label=m)
        p = projections[m]
        if p["value"] is not None:
            ax.errorbar([final], [p["value"]], yerr=[[p["value"] - p["lo"]], [p["hi"] - p["value"]]],
                        fmt="x", capsize=4, label=f"{m} projected ({p['model']})")
    ax.set_xlabel("step")
    ax.set_ylabel("real τ")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
