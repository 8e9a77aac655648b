"""Real τ of one run's checkpoints against steps and target tokens, with a projection.

    python bench/tau_curve.py --run outputs/smollm2_long2 --every 1500 --prompts humaneval \\
        --limit 20 --eval-overrides target=smollm2 dtype=float32

Evaluates every ``--every``-th periodic checkpoint of a run (``checkpoints/step*.ckpt``, kept
with ``callbacks.model_checkpoint.save_top_k=-1``) by real speculative decoding
(``evaluate.py``, lossless checked; a report already written is read back), and writes
``bench/results/tau_curve_<name>.{json,md,png}``: τ per method against steps and target tokens,
and ``dflash_lit.analyze``'s projection of each τ to ``--project-to`` (the model chosen on
held-out points, its 10-90 % bootstrap band; none below its minimum number of points). With
``--goal chain=3.0`` it also inverts the fit: the step (and target tokens, and CPU hours at the
run's own median step time) at which the projection reaches the goal, with the band of the
bootstrap refits. Several ``--run`` directories (a run and its continuation) form one curve.

Read a curve of one cosine schedule for what it is: its late flattening is partly the
learning-rate decay, so its projection past the run's own last step is a lower bound for a
longer schedule, not a forecast of one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from common import REPO, RESULTS, fmt_table, write_result

from dflash_lit.analyze.fits import MIN_POINTS, first_crossing, project, steps_to_reach
from dflash_lit.analyze.logs import read_metrics_csv
from dflash_lit.checkpoint import safe_load


def checkpoints(run: Path, every: int) -> list[tuple[int, Path]]:
    """(step, path) of the run's periodic checkpoints at multiples of ``every``, then last.ckpt
    (in place of a periodic one less than ``every / 10`` steps before it)."""
    out = []
    for p in sorted((run / "checkpoints").glob("step*.ckpt")):
        step = int(re.sub(r"\D", "", p.stem))
        if step % every == 0:
            out.append((step, p))
    last = run / "checkpoints" / "last.ckpt"
    if last.is_file():
        step = int(safe_load(last).get("global_step", 0))
        # last.ckpt stands for a periodic checkpoint only a few steps before it
        out = [(s, p) for s, p in out if not 0 < step - s < every / 10]
        if not out or step > out[-1][0]:
            out.append((step, last))
    return out


def median_step_seconds(runs: list[Path]) -> float | None:
    """Median ``perf/step_s`` over the runs' CSV logs (None when none is logged)."""
    vals = []
    for run in runs:
        for csv in sorted(run.glob("csv/**/metrics.csv")):
            df, _ = read_metrics_csv(csv)
            if "perf/step_s" in df:
                vals += df["perf/step_s"].dropna().tolist()
    return float(torch.tensor(vals).median()) if vals else None


def parse_goals(items: list[str]) -> dict[str, float]:
    """``["chain=3.0"]`` -> {"chain": 3.0}; a one-line error on a malformed item."""
    goals = {}
    for it in items:
        name, _, val = it.partition("=")
        try:
            goals[name] = float(val)
        except ValueError:
            name = ""
        if not name:
            raise SystemExit(f"--goal {it!r}: expected METHOD=VALUE, e.g. chain=3.0")
    return goals


def evaluate(ckpt: Path, out: Path, args) -> dict:
    """evaluate.py's report for one checkpoint (read back when already written). With
    ``--jobs`` > 1 each evaluation runs single-threaded, so that N of them share N cores."""
    if not (out / "report.json").is_file():
        cmd = [sys.executable, str(REPO / "evaluate.py"), f"ckpt={ckpt}",
               f"prompts={args.prompts}", f"limit={args.limit}",
               f"max_new_tokens={args.max_new_tokens}", f"methods={args.methods}",
               f"budgets=[{args.budget}]", "progress=false", "plot=false", f"out={out}",
               *args.eval_overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.jobs > 1 else None
        subprocess.run(cmd, check=True, cwd=REPO, env=env)
    return json.loads((out / "report.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, nargs="+",
                    help="training run directories (a run, then its continuations)")
    ap.add_argument("--every", type=int, default=1500, help="evaluate checkpoints at multiples of this step")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="[chain]", help="evaluate.py methods")
    ap.add_argument("--budget", type=int, default=16, help="DDTree node budget")
    ap.add_argument("--project-to", type=int, default=None, help="projection step (default 2x the last)")
    ap.add_argument("--name", default=None, help="result name (default: the run directory's name)")
    ap.add_argument("--goal", nargs="*", default=[],
                    help="METHOD=VALUE: the step at which the projection reaches VALUE")
    ap.add_argument("--horizon", type=float, default=1000.0,
                    help="search --goal crossings up to this multiple of the last step")
    ap.add_argument("--eval-overrides", nargs="*", default=[])
    ap.add_argument("--jobs", type=int, default=1,
                    help="checkpoints evaluated at once, each single-threaded (the greedy "
                         "reference of every evaluation is the slow, serial part)")
    args = ap.parse_args()
    goals = parse_goals(args.goal)
    name = args.name or args.run[0].name
    work = REPO / "outputs" / "bench" / f"tau_curve_{name}"
    rows, todo = [], {}
    for step, ckpt in [c for run in args.run for c in checkpoints(run, args.every)]:
        todo.setdefault(step, ckpt)  # a continuation's first checkpoint may repeat its parent's last
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        reports = list(pool.map(lambda sc: evaluate(sc[1], work / f"step{sc[0]}", args),
                                todo.items()))
    for (step, ckpt), rep in zip(todo.items(), reports):
        meta = safe_load(ckpt).get("dflash", {})
        row = {"step": step, "tokens": meta.get("tokens_seen"), "lossless": rep["lossless"]}
        row.update({k: v["tau"] for k, v in rep["methods"].items() if k != "baseline"})
        rows.append(row)
    if not rows:
        raise SystemExit(f"{args.run}: no checkpoints at multiples of {args.every}")
    methods = [k for k in rows[-1] if k not in ("step", "tokens", "lossless")]
    final = args.project_to or 2 * rows[-1]["step"]
    steps = torch.tensor([r["step"] for r in rows], dtype=torch.float64).numpy()
    projections, reaches, per_model, fits = {}, [], [], {}
    step_s = median_step_seconds(args.run)
    last = rows[-1]
    tok_per_step = last["tokens"] / last["step"] if last.get("tokens") else None
    for m in methods:
        pr = project(steps, torch.tensor([r[m] for r in rows]).numpy(), final, metric=f"tau_{m}")
        fits[m] = pr.fits
        projections[m] = {"value": pr.value, "lo": pr.lo, "hi": pr.hi, "note": pr.note,
                          "model": pr.chosen.name if pr.chosen else None}
        if m in goals:
            r = steps_to_reach(pr, goals[m], start=last["step"], horizon=args.horizon * last["step"])
            row = {"method": m, "goal": r.goal, "model": projections[m]["model"]}
            for key in ("step", "lo", "hi"):
                v = getattr(r, key)
                row[key] = None if v is None else round(v)
                row[f"{key}_x_run"] = None if v is None else round(v / last["step"], 1)
                row[f"{key}_cpu_h"] = None if v is None or step_s is None else round(v * step_s / 3600, 1)
            row["tokens"] = None if r.step is None or tok_per_step is None else round(r.step * tok_per_step)
            row["never_share"] = r.never
            reaches.append(row)
            for f in pr.fits:  # every model's own answer: the choice between them matters most
                x = first_crossing(f.name, f.params, goals[m], last["step"],
                                   args.horizon * last["step"])
                per_model.append({
                    "method": m, "model": f.name, "chosen": f is pr.chosen,
                    "value_at_projected_step": round(float(f.predict(final)), 3),
                    "holdout_rmse": f.holdout_rmse, "aic": round(f.aic, 1),
                    "goal_step": None if x == float("inf") else round(x),
                    "goal_x_run": None if x == float("inf") else round(x / last["step"], 1)})
    table = fmt_table(rows, ["step", "tokens", *methods, "lossless"])
    table += "\n\n" + fmt_table(
        [{"method": m, "projected_step": final, **p} for m, p in projections.items()],
        ["method", "projected_step", "value", "lo", "hi", "model", "note"])
    if reaches:
        table += "\n\n" + fmt_table(reaches, list(reaches[0]))
        table += (f"\n\nSteps at which the projection reaches the goal, searched up to "
                  f"{args.horizon:g}x the last step: the chosen fit (step), the 10-90 % band of "
                  "its bootstrap refits (lo, hi; None: beyond the horizon or never), as a multiple "
                  f"of the curve's last step (x_run) and in CPU hours at its median step of "
                  f"{step_s if step_s is None else round(step_s, 3)} s.")
        table += "\n\n" + fmt_table(per_model, list(per_model[0]))
        table += ("\n\nEach model fitted to all points on its own (goal_step None: it never "
                  "reaches the goal within the horizon).")
    table += (f"\n\n{args.prompts}, first {args.limit} prompts x {args.max_new_tokens} tokens; "
              f"projection needs >= {MIN_POINTS} points; one cosine schedule's curve flattens "
              "with its learning rate, so past its last step the projection is a lower bound.\n")
    write_result(f"tau_curve_{name}", {"runs": [r.name for r in args.run], "rows": rows,
                                       "projections": projections, "reaches": reaches, "per_model": per_model,
                                       "step_s": step_s}, table)
    _plot(rows, methods, projections, fits, goals, final, RESULTS / f"tau_curve_{name}.png")


def _plot(rows, methods, projections, fits, goals, final, path: Path) -> None:
    """Measured τ, every fitted model out to the projected step (chosen one solid), goals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = np.geomspace(rows[0]["step"], final, 200)
    for i, m in enumerate(methods):
        color = f"C{i}"
        ax.plot([r["step"] for r in rows], [r[m] for r in rows], "o", color=color, label=m)
        for f in fits.get(m, []):
            chosen = f.name == projections[m]["model"]
            ax.plot(xs, f.predict(xs), "-" if chosen else ":", color=color, lw=1.5 if chosen else 1,
                    alpha=0.9 if chosen else 0.6)
            ax.annotate(f.name, (xs[-1], float(f.predict(xs[-1:])[0])), fontsize=7, color=color,
                        xytext=(3, 0), textcoords="offset points", va="center")
        p = projections[m]
        if p["value"] is not None:
            ax.errorbar([final], [p["value"]], yerr=[[p["value"] - p["lo"]], [p["hi"] - p["value"]]],
                        fmt="x", color=color, capsize=4, label=f"{m} projected ({p['model']}, 10-90 %)")
        if m in goals:
            ax.axhline(goals[m], color=color, ls="--", lw=1, label=f"{m} goal {goals[m]:g}")
    ax.set_xscale("log")
    ax.set_xlabel("optimizer step (log)")
    ax.set_ylabel("real τ")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
