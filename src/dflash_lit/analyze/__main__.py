"""``python -m dflash_lit.analyze RUN_DIR [RUN_DIR ...]``: training-log analysis + plots."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; must precede any pyplot import

from dflash_lit.analyze.analysis import Options, RunAnalysis, analyze_run  # noqa: E402
from dflash_lit.analyze.compare import compare_runs  # noqa: E402
from dflash_lit.analyze.logs import LogError, Run, load_run  # noqa: E402
from dflash_lit.analyze.report import fmt, write_compare_report, write_run_report  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_lit.analyze",
        description="Diagnose training runs from their logs (CSV metrics or W&B history): "
        "improvement velocity and projection, per-batch loss distribution, gradient norms, "
        "epoch-boundary and resume jumps. Writes RUN/analysis/{report.md,summary.json,*.png}.")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run dir (outputs/<run_name>/<timestamp>), outputs/<run_name> (its "
                   "newest run), a W&B offline run dir / .wandb file, or wandb:entity/project/id")
    p.add_argument("--out", type=Path, default=None,
                   help="output dir (several runs: OUT/<run>/ each and OUT/compare/)")
    p.add_argument("--segment", type=int, default=None, metavar="K",
                   help="steps per velocity segment (default: the run split into --segments)")
    p.add_argument("--segments", type=int, default=8, help="segments when --segment is unset")
    p.add_argument("--final-step", type=int, default=None,
                   help="project metrics at this step (default: trainer.max_steps, else "
                   "max_epochs x steps/epoch, else last step x 2)")
    p.add_argument("--skip-frac", type=float, default=0.1,
                   help="warm-up share of steps left out of the loss distribution")
    p.add_argument("--loss-thresholds", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="report the share of batches below LO / above HI (default: median ± 2 "
                   "robust sigma of the detrended loss)")
    p.add_argument("--window", type=int, default=None,
                   help="logged points each side of an epoch boundary / resume (default ~1/8 "
                   "of the run, 3..50)")
    p.add_argument("--z-threshold", type=float, default=3.0,
                   help="flag jumps beyond this many sigma of the pre-event residuals")
    p.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples")
    p.add_argument("--source", choices=["csv", "wandb"], default="csv",
                   help="which logs to read when a run dir has both")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (faster)")
    return p


def _short(run: Run, a: RunAnalysis) -> str:
    lines = [f"{a.run}: steps {a.first_step}-{a.last_step}"
             + (f", resumed {len(run.resumes)}x" if run.resumes else "")]
    for d in a.drafters:
        proj = a.projection.get(d, {})
        pa = proj.get("acc")
        extra = ""
        if pa is not None and pa.value is not None:
            extra = (f"; acc at step {a.final_step}: {fmt(pa.value, 3)} "
                     f"[{fmt(pa.lo, 3)}, {fmt(pa.hi, 3)}] ({pa.chosen.name})")
        lines.append(f"  {d}: {a.verdicts.get(d, '?')}{extra}")
    lines += [f"  ! {f}" for f in a.flags]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = Options(segment=args.segment, n_segments=args.segments, final_step=args.final_step,
                   skip_frac=args.skip_frac,
                   thresholds=tuple(args.loss_thresholds) if args.loss_thresholds else None,
                   window=args.window, z_threshold=args.z_threshold, n_boot=args.bootstrap)
    runs = []
    try:
        for r in args.runs:
            runs.append(load_run(r, prefer=args.source))
    except LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    several = len(runs) > 1
    names = compare_runs(runs).runs if several else [runs[0].name]
    for run, name in zip(runs, names):
        if args.out is None:
            out = run.path / "analysis"
        else:
            out = args.out / name.replace("/", "_") if several else args.out
        a = analyze_run(run, opts)
        path = write_run_report(run, a, out, figures=not args.no_plots)
        print(f"report: {path}")
        print(_short(run, a))
    if several:
        comp = compare_runs(runs)
        out = (args.out / "compare") if args.out else runs[0].path / "analysis" / "compare"
        path = write_compare_report(runs, comp, out, figures=not args.no_plots)
        print(f"comparison: {path} ({len(comp.shared)} shared metrics)")
        for n, miss in comp.missing.items():
            if miss:
                print(f"  {n} lacks {len(miss)} metric(s) the others have")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
