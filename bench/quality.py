"""Recipe ranking on the embedded default at an equal training budget, over several seeds.

Recipes: v3_composite, v4_5layer, v5_hardce, v6_dpace, v6_muon, and the γ sweep
(multi_drafter: v5 drafters with γ = 4, 7, 10 off one target forward). Each recipe trains once
per seed with the default budget (`budget=tiny`, plus ``--train-overrides``), then each of its
drafters is evaluated with real greedy speculative decoding (chain, DDTree-16 and the latest-occurrence n-gram
baseline, lossless checked) on HumanEval and on the held-out default prompts. The table gives
mean ± standard deviation over the seeds of the final val streak and of every τ, and each
recipe's chain τ relative to v5's.

Every run lives in ``outputs/bench_quality/<recipe>_seed<s>/``, and a finished step is never
redone. A run that has ``done.json`` is not retrained. A killed run resumes from its
``last.ckpt``. An evaluation whose ``report.json`` exists is read back. Every row ever
measured stays in ``bench/results/quality.json`` with its prompt settings and training
overrides (by this machine or another); a (recipe, seed) recorded with the same settings is
not rerun unless ``--redo`` is given, and each invocation rewrites the table from all the
recorded rows of its settings. So the whole grid (18 runs of 12-40 min
on 2 CPU cores, plus evaluation) can run in pieces, in parallel, across machines.

    python bench/quality.py [--recipes v5_hardce v6_dpace ...] [--seeds 0 1 2] [--limit 40]
    python bench/quality.py --table-only      # the table from what has been recorded so far
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, fmt_table, write_result
from omegaconf import OmegaConf

from dflash_lit.analyze.logs import read_metrics_csv

# recipe -> its drafters' names (multi_drafter trains three off one target forward)
RECIPES = {"v3_composite": ["main"], "v4_5layer": ["main"], "v5_hardce": ["main"],
           "v6_dpace": ["main"], "v6_muon": ["main"],
           "multi_drafter": ["gamma4", "gamma7", "gamma10"]}
PROMPT_SETS = {"humaneval": "he", "tiny_heldout": "ho"}
TREE_BUDGET = 16
ROOT = REPO / "outputs" / "bench_quality"
RECORD = REPO / "bench" / "results" / "quality.json"
EXIT_STREAK = 3.0  # train streak that marks leaving the plateau (below 1 on it, ~9 past it)
EXIT_WINDOW = 50  # logged steps the streak must average EXIT_STREAK over
SLOTS_SHOWN = (1, 2, 3, 4, 8, 15)  # slots of the per-slot chain acceptance table


def base_recipe(row: dict) -> str:
    """The recipe a row belongs to (``multi_drafter/gamma4`` -> ``multi_drafter``)."""
    return row["recipe"].split("/")[0]


def recorded_rows() -> list[dict]:
    """Every row in the results file, each carrying its prompt settings and overrides."""
    if not RECORD.is_file():
        return []
    rec = json.loads(RECORD.read_text())
    return [{"limit": rec.get("limit"), "max_new_tokens": rec.get("max_new_tokens"),
             "train_overrides": [], **r} for r in rec.get("rows", [])]


def settings(r: dict) -> tuple:
    """What makes two rows comparable: prompt count and length, and the training overrides."""
    return r["limit"], r["max_new_tokens"], tuple(r["train_overrides"])


def last_val(run_dir: Path, drafter: str) -> dict[str, float]:
    """Final validation acc/streak/loss of ``drafter`` from the run's CSV."""
    df, _ = read_metrics_csv(run_dir / "csv" / "metrics.csv")
    vals: dict[str, float] = {}
    for k in ("acc", "streak", "loss"):
        col = df.get(f"val/{drafter}/{k}")
        if col is not None and col.notna().any():
            vals[k] = float(col.dropna().iloc[-1])
    return vals


def plateau_exit_step(run_dir: Path, drafter: str) -> int | None:
    """The step the drafter left the copy-the-anchor plateau: the first logged training step
    from which its windowed train streak averages >= ``EXIT_STREAK`` over the next
    ``EXIT_WINDOW`` logged steps (a single step past it can be a spike: a seed that drops
    back to the plateau would otherwise read as an early exit); None if it never does.
    LookupError if the log does not start at step 0: the exit step is unknown."""
    df, _ = read_metrics_csv(run_dir / "csv" / "metrics.csv")
    key = f"train_window/{drafter}/streak"
    if key not in df:
        return None  # never logged: never left
    rows = df[["step", key]].dropna()
    series = [(int(st), float(v)) for st, v in zip(rows["step"], rows[key])]
    if series and series[0][0] > 0:  # the log lost its start (a resume that overwrote it)
        raise LookupError(f"{run_dir}: the training log starts at step {series[0][0]}")
    for i in range(len(series) - EXIT_WINDOW + 1):
        if sum(v for _, v in series[i:i + EXIT_WINDOW]) >= EXIT_STREAK * EXIT_WINDOW:
            return series[i][0]
    return None


def exit_step_entry(run_dir: Path, drafter: str) -> dict:
    """``{"exit_step": step or None}``, or ``{}`` when the log cannot tell (shown as ``?``)."""
    try:
        return {"exit_step": plateau_exit_step(run_dir, drafter)}
    except LookupError:
        return {}


def run_precision(run_dir: Path) -> str | None:
    """The trainer precision the run resolved to (``trainer.precision=${cpu_precision:}``
    picks bf16-mixed only on CPUs with fast bf16 matmuls, so it can differ across machines)."""
    cfg = run_dir / "config_resolved.yaml"
    if not cfg.is_file():
        return None
    return str(OmegaConf.load(cfg).trainer.precision)


def chain_slot_rates(report: dict) -> list[float]:
    """Share of an evaluation's chain steps that accepted slots 1..k, k = 1..Bs-1."""
    return list(report["methods"]["chain"]["slot_accept_rate"])


def fill_exit_step(row: dict) -> None:
    """(Re)compute a recorded row's exit step and precision, and add its per-slot chain
    acceptance when missing, from its run directory, if that directory is still here,
    finished, and holds the same run (same final val streak): a rerun in progress or another
    machine's run must not lend its figures."""
    run_dir = run_dir_for(base_recipe(row), row["seed"], row["train_overrides"])
    drafter = row["recipe"].split("/")[1] if "/" in row["recipe"] else "main"
    if ((run_dir / "done.json").is_file()
            and last_val(run_dir, drafter).get("streak") == row.get("val_streak")):
        row.pop("exit_step", None)
        row.update(exit_step_entry(run_dir, drafter))
        row["precision"] = run_precision(run_dir)
        for prompts, tag in PROMPT_SETS.items():
            rep = run_dir / "eval" / f"{prompts}_{drafter}" / "report.json"
            if f"{tag}_chain_slots" not in row and rep.is_file():
                row[f"{tag}_chain_slots"] = chain_slot_rates(json.loads(rep.read_text()))


def run_dir_for(recipe: str, seed: int, overrides: list[str]) -> Path:
    """``<recipe>_seed<s>``, plus a digest of the training overrides when there are any (a run
    under other overrides is another run)."""
    tag = hashlib.sha1(" ".join(overrides).encode()).hexdigest()[:8] if overrides else ""
    return ROOT / f"{recipe}_seed{seed}{'_' + tag if tag else ''}"


def train(recipe: str, seed: int, overrides: list[str]) -> Path:
    """Train (or resume, or skip) one recipe at one seed; returns its run directory."""
    run_dir = run_dir_for(recipe, seed, overrides)
    if (run_dir / "done.json").is_file():
        return run_dir
    cmd = [sys.executable, str(REPO / "train.py"), f"experiment={recipe}", f"seed={seed}",
           *overrides, f"hydra.run.dir={run_dir}"]
    last = run_dir / "checkpoints" / "last.ckpt"
    if last.is_file():  # a killed run: continue it exactly
        cmd.append(f"ckpt_path={last}")
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=REPO)
    (run_dir / "done.json").write_text(json.dumps({"wall_s": time.time() - t0,
                                                   "overrides": overrides}) + "\n")
    return run_dir


def evaluate(run_dir: Path, drafter: str, prompts: str, limit: int, max_new: int) -> dict:
    """Real speculative decoding of one drafter on one prompt set (read back if done)."""
    out = run_dir / "eval" / f"{prompts}_{drafter}"
    if not (out / "report.json").is_file():
        cmd = [sys.executable, str(REPO / "evaluate.py"),
               f"ckpt={run_dir / 'checkpoints' / 'last.ckpt'}", f"drafter={drafter}",
               f"prompts={prompts}", f"limit={limit}", f"max_new_tokens={max_new}",
               f"budgets=[{TREE_BUDGET}]", "methods=[chain,tree,ngram]", "ngram.rule=latest", "progress=false",
               f"out={out}"]
        subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads((out / "report.json").read_text())


def run_row(recipe: str, drafter: str, seed: int, run_dir: Path, limit: int, max_new: int,
            evaluate_missing: bool = True) -> dict | None:
    """One (recipe, drafter, seed): val metrics and τ on every prompt set, or None when an
    evaluation is missing and ``evaluate_missing`` is off."""
    row = {"recipe": recipe if drafter == "main" else f"{recipe}/{drafter}", "seed": seed,
           **{f"val_{k}": v for k, v in last_val(run_dir, drafter).items()},
           **exit_step_entry(run_dir, drafter), "precision": run_precision(run_dir)}
    for prompts, tag in PROMPT_SETS.items():
        if not evaluate_missing and not (run_dir / "eval" / f"{prompts}_{drafter}" /
                                         "report.json").is_file():
            return None
        rep = evaluate(run_dir, drafter, prompts, limit, max_new)
        row[f"{tag}_chain"] = rep["tau_chain"]
        row[f"{tag}_tree{TREE_BUDGET}"] = rep["tau_tree"].get(str(TREE_BUDGET))
        row[f"{tag}_ngram"] = rep["tau_ngram"]
        row[f"{tag}_lossless"] = rep["lossless"]
        row[f"{tag}_chain_slots"] = chain_slot_rates(rep)
    return row


def mean_sd(xs: list[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs):.2f}"


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean ± sample standard deviation over seeds, per recipe (and drafter)."""
    cols = ["val_streak", *(f"{t}_{m}" for t in PROMPT_SETS.values()
                            for m in ("chain", f"tree{TREE_BUDGET}", "ngram"))]
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["recipe"], []).append(r)
    ref = by.get("v5_hardce")
    out = []
    for recipe, rs in by.items():
        agg = {"recipe": recipe, "seeds": len(rs),
               # per seed, not averaged: one late exit is what a mean would hide
               "exit_steps": "/".join("?" if "exit_step" not in r else
                                      "never" if r["exit_step"] is None else str(r["exit_step"])
                                      for r in rs),
               "precision": "+".join(sorted({str(r.get("precision")) for r in rs}))}
        for c in cols:
            agg[c] = mean_sd([r[c] for r in rs if r.get(c) is not None])
        agg["lossless"] = all(r[f"{t}_lossless"] for r in rs for t in PROMPT_SETS.values())
        if ref:  # chain τ relative to v5's mean, per prompt set
            for t in PROMPT_SETS.values():
                base = statistics.mean(r[f"{t}_chain"] for r in ref)
                agg[f"{t}_chain_vs_v5"] = mean_sd([r[f"{t}_chain"] / base for r in rs])
        out.append(agg)
    return out


def slot_table(rows: list[dict], tag: str = "he") -> list[dict]:
    """Per recipe (and drafter), mean ± sd over seeds of the share of chain steps that
    accepted slots 1..k, at the ``SLOTS_SHOWN`` slots, over the rows that recorded it."""
    by: dict[str, list[list[float]]] = {}
    for r in rows:
        if r.get(f"{tag}_chain_slots"):
            by.setdefault(r["recipe"], []).append(r[f"{tag}_chain_slots"])
    return [{"recipe": recipe, "seeds": len(rs),
             **{f"slot{k}": mean_sd([s[k - 1] for s in rs if len(s) >= k]) for k in SLOTS_SHOWN}}
            for recipe, rs in by.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--limit", type=int, default=40, help="prompts per prompt set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--train-overrides", nargs="*", default=[])
    ap.add_argument("--table-only", action="store_true",
                    help="no training or evaluation: the table from the recorded rows and "
                         "the finished runs")
    ap.add_argument("--redo", action="store_true",
                    help="rerun (recipe, seed) pairs already recorded in the results file")
    args = ap.parse_args()
    mine = (args.limit, args.max_new_tokens, tuple(args.train_overrides))
    done = {(base_recipe(r), r["seed"]) for r in recorded_rows() if settings(r) == mine}
    rows = []
    for recipe in args.recipes:
        for seed in args.seeds:
            run_dir = run_dir_for(recipe, seed, args.train_overrides)
            if (recipe, seed) in done and not args.redo:
                continue
            if args.table_only and not (run_dir / "done.json").is_file():
                continue
            if not args.table_only:
                run_dir = train(recipe, seed, args.train_overrides)
            for drafter in RECIPES[recipe]:
                row = run_row(recipe, drafter, seed, run_dir, args.limit, args.max_new_tokens,
                              evaluate_missing=not args.table_only)
                if row is not None:
                    row.update(limit=args.limit, max_new_tokens=args.max_new_tokens,
                               train_overrides=args.train_overrides)
                    rows.append(row)
                    print(row, flush=True)
    # Re-read the record now: another invocation may have added rows while this one ran.
    new = {(base_recipe(r), r["seed"]) for r in rows}
    kept = [r for r in recorded_rows()
            if settings(r) != mine or (base_recipe(r), r["seed"]) not in new]
    for r in kept:
        if settings(r) == mine:
            fill_exit_step(r)
    order = {name: i for i, name in enumerate(RECIPES)}
    def key(r: dict) -> tuple:  # recipes in RECIPES order, a recipe's drafters in theirs
        name = r["recipe"].split("/")[1] if "/" in r["recipe"] else "main"
        return order[base_recipe(r)], RECIPES[base_recipe(r)].index(name), r["seed"]

    every = sorted(kept + rows, key=key)
    rows = [r for r in every if settings(r) == mine]  # the table: this invocation's settings
    if not rows:
        raise SystemExit(f"no finished run under {ROOT.relative_to(REPO)}/")
    agg, slots = aggregate(rows), slot_table(rows)
    budget = " ".join(args.train_overrides) or "budget=tiny (the default)"
    table = fmt_table(agg) + (
        f"\n\nmean ± sd over seeds; he = HumanEval, ho = held-out default prompts (first "
        f"{args.limit} each, max_new_tokens={args.max_new_tokens}); chain, DDTree-{TREE_BUDGET}"
        f" and n-gram τ (latest-occurrence rule) from evaluate.py; equal budget for every recipe: {budget}")
    if slots:
        table += ("\n\n" + fmt_table(slots) + "\n\nHumanEval chain: share of drafting steps that "
                  "accepted slots 1..k, mean ± sd over the seeds that recorded it")
    write_result("quality", {"rows": every, "aggregate": agg, "chain_slots": slots,
                             "limit": args.limit, "max_new_tokens": args.max_new_tokens}, table)


if __name__ == "__main__":
    main()
