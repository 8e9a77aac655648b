"""Quality table on the embedded default at an equal training budget: v3_composite,
v4_5layer, v5_hardce and γ ∈ {4, 7, 10} (multi_drafter: three drafters, one target forward).
Offline val acc/streak from each run's CSV; τ on HumanEval (chain, DDTree b=8, n-gram
baseline) through evaluate.py. Slow (about 12 min of training per run on 2 CPU cores, plus
evaluation): run it, then copy its table into docs/BENCHMARKS.md.

    python bench/quality.py [--limit 40] [--max-new-tokens 128] [--runs v3_composite ...]
    python bench/quality.py --from-dirs v5_hardce=outputs/v5_hardce/<ts> ...   # reuse runs
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

from common import REPO, fmt_table, write_result

RUNS = {"v3_composite": ["main"], "v4_5layer": ["main"], "v5_hardce": ["main"],
        "multi_drafter": ["gamma4", "gamma7", "gamma10"]}


def newest_run(name: str) -> Path:
    runs = sorted((REPO / "outputs" / name).glob("20*/checkpoints/last.ckpt"))  # not multirun_*
    if not runs:
        raise SystemExit(f"no finished run under outputs/{name}/")
    return runs[-1].parent.parent


def last_val(run_dir: Path, drafter: str) -> dict[str, float]:
    """Final validation acc/streak/loss of ``drafter`` from the run's CSV (and any it resumed)."""
    vals: dict[str, float] = {}
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for k in ("acc", "streak", "loss"):
                v = row.get(f"val/{drafter}/{k}")
                if v not in (None, ""):
                    vals[k] = float(v)
    return vals


def evaluate(run_dir: Path, drafter: str, limit: int, max_new: int) -> dict:
    out = run_dir / "eval" / f"humaneval_{drafter}"
    cmd = [sys.executable, str(REPO / "evaluate.py"), f"ckpt={run_dir / 'checkpoints/last.ckpt'}",
           f"drafter={drafter}", "prompts=humaneval", f"limit={limit}",
           f"max_new_tokens={max_new}", "budgets=[8]", "methods=[chain,tree,ngram]",
           "progress=false", f"out={out}"]
    subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads((out / "report.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", nargs="+", default=list(RUNS))
    ap.add_argument("--from-dirs", nargs="*", default=[], help="NAME=RUN_DIR: skip training")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--train-overrides", nargs="*", default=[])
    args = ap.parse_args()
    given = dict(kv.split("=", 1) for kv in args.from_dirs)
    rows = []
    for name in args.runs:
        if name in given:
            run_dir = Path(given[name]).resolve()
        else:
            subprocess.run([sys.executable, str(REPO / "train.py"), f"experiment={name}",
                            *args.train_overrides], check=True, cwd=REPO)
            run_dir = newest_run(name)
        for drafter in RUNS[name]:
            rep = evaluate(run_dir, drafter, args.limit, args.max_new_tokens)
            val = last_val(run_dir, drafter)
            rows.append({
                "recipe": name if drafter == "main" else f"{name}/{drafter}",
                "val_acc": val.get("acc"), "val_streak": val.get("streak"),
                "tau_chain": rep["tau_chain"], "tau_tree_b8": rep["tau_tree"].get("8"),
                "tau_ngram": rep["tau_ngram"], "lossless": rep["lossless"],
                "run_dir": str(run_dir.relative_to(REPO)),
            })
            print(rows[-1], flush=True)
    budget = " ".join(args.train_overrides) or "budget=tiny (2 epochs)"
    table = fmt_table(rows) + (f"\n\nHumanEval: first {args.limit} prompts, "
                               f"max_new_tokens={args.max_new_tokens}; equal budget for every "
                               f"recipe: {budget}, same data")
    write_result("quality", {"rows": rows, "limit": args.limit,
                             "max_new_tokens": args.max_new_tokens}, table)


if __name__ == "__main__":
    main()
