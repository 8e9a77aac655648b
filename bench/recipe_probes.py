"""Recipe probes for a real target: short training runs at equal steps on one feature cache,
compared by their validation curves (the issue's "learning curves at equal steps").

Each probe is ``train.py <base overrides> <its overrides> trainer.max_steps=<steps>`` with
validation every ``--val-every`` steps and no real-tau callback (decoding through the target
would dominate a short run); the base builds the feature cache once and every probe reuses it
(same target, layers, data and length policy: the same fingerprint). Reported per probe: the
validation curve (acc, slot-1 acc, streak, loss) and the last values, train loss, wall time,
each as a ratio to the first probe where it helps.

    python bench/recipe_probes.py --steps 600 \\
        --probe base= --probe lr4e-3=optim.lr=4e-3 --probe anchors32=anchor_scale=0.0625

Probes run one after another (two training jobs on two cores slow each other far more than
2x). Results: ``bench/results/recipe_probes_<tag>.{json,md}``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, fmt_table, write_result

from dflash_lit.analyze.logs import read_metrics_csv

BASE = ["experiment=v6_muon", "target=smollm2", "data=smollm2", "drafter=smollm2",
        "budget=smollm2_cpu"]
KEYS = {"acc": "acc", "slot1": "acc_pos/1", "streak": "streak", "loss": "loss"}


def parse_probe(text: str) -> tuple[str, list[str]]:
    """``name=ov1,ov2`` -> (name, [ov1, ov2]); ``name=`` is the base alone. Overrides are
    split on ``,`` outside brackets."""
    name, _, rest = text.partition("=")
    out, depth, cur = [], 0, ""
    for ch in rest:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return name, [o for o in out + [cur] if o]


def curve(run_dir: Path) -> tuple[list[dict], float | None, float | None]:
    """Validation rows [{step, acc, slot1, streak, loss}], the last logged train loss and the
    median optimizer-step seconds (the run's own ``perf/step_s``)."""
    df, _ = read_metrics_csv(run_dir / "csv" / "metrics.csv")
    cols = {k: f"val/main/{c}" for k, c in KEYS.items()}
    rows = []
    if cols["acc"] in df:
        val = df.dropna(subset=[cols["acc"]])
        rows = [{"step": int(r["step"]), **{k: float(r[c]) for k, c in cols.items() if c in df}}
                for _, r in val.iterrows()]
    train = df["train/main/loss"].dropna() if "train/main/loss" in df else []
    step_s = df["perf/step_s"].dropna() if "perf/step_s" in df else []
    return (rows, float(train.tail(50).mean()) if len(train) else None,
            float(step_s.median()) if len(step_s) else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", action="append", required=True,
                    help="name=override,override (name= for the base recipe)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--val-every", type=int, default=200)
    ap.add_argument("--base", nargs="*", default=BASE)
    ap.add_argument("--tag", default="smollm2")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "recipe_probes")
    args = ap.parse_args()
    results = []
    for text in args.probe:
        name, overrides = parse_probe(text)
        run_dir = args.out / name
        cmd = [sys.executable, "train.py", *args.base, *overrides,
               f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.val_every}",
               "trainer.check_val_every_n_epoch=null", "~callbacks.real_tau", "logger=csv",
               f"run_name=probe_{name}", f"hydra.run.dir={run_dir}"]
        print("+", " ".join(cmd), flush=True)
        wall = None
        if not (run_dir / "csv" / "metrics.csv").is_file():
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, cwd=REPO)
            wall = round(time.perf_counter() - t0, 1)
        rows, train_loss, step_s = curve(run_dir)
        last = rows[-1] if rows else {}
        results.append({"probe": name, "overrides": overrides, "steps": args.steps,
                        "wall_s": wall, "step_s": step_s, "train_loss": train_loss,
                        "curve": rows, **{f"val_{k}": last.get(k) for k in KEYS}})
    base = results[0]
    for r in results:
        r["slot1_vs_first"] = (r["val_slot1"] / base["val_slot1"]
                               if r["val_slot1"] and base["val_slot1"] else None)
        r["step_s_vs_first"] = (r["step_s"] / base["step_s"]
                                if r["step_s"] and base["step_s"] else None)
    table = fmt_table(results, ["probe", "overrides", "steps", "val_acc", "val_slot1",
                                "val_streak", "val_loss", "train_loss", "slot1_vs_first",
                                "step_s", "step_s_vs_first"])
    table += (f"\n\nbase: {' '.join(args.base)}; validation every {args.val_every} steps "
              "(the data's val split), no real tau; one feature cache for all probes. "
              "step_s: the median optimizer step of the probe's own CSV (probes run one after "
              "another; a probe read back from an earlier run keeps its own figures).\n")
    write_result(f"recipe_probes_{args.tag}", {"probes": results, "base": args.base}, table)


if __name__ == "__main__":
    main()
