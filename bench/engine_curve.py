"""Drafters against vLLM's model-free methods, in vLLM: tokens/s of each drafter over the
engine's fastest model-free method, against the CPU time its training took.

    python bench/engine_curve.py --run v5_hardce=outputs/ship/v5_hardce \
        --run v6_muon=outputs/ship/v6_muon --run v6_muon_x3=outputs/ship/v6_muon_e12

Each ``--run NAME=RUN_DIR`` (a training run directory; its ``checkpoints/last.ckpt`` is
exported on the fly) runs ``evaluate.py engine=vllm methods=[chain]``; one more evaluation
runs the engine's ``ngram`` and ``suffix`` (they do not depend on the drafter). Every
evaluation serves the same held-out prompts with plain vLLM too, so each ratio is taken
against the figures of the same kind of engine run. Training time is the sum of the run's step
times (``csv/metrics.csv``). Writes ``bench/results/<name>.{json,md,png}``; evaluations already
written are read back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import REPO, fmt_table, machine_info, write_result

from dflash_lit.export.card import run_facts


def evaluate(out: Path, ckpt: str, methods: str, args: argparse.Namespace) -> dict:
    """One ``evaluate.py engine=vllm`` run into ``out`` (read back when its report exists)."""
    if not (out / "report.json").is_file():
        cmd = [sys.executable, str(REPO / "evaluate.py"), "engine=vllm", f"ckpt={ckpt}",
               f"prompts={args.prompts}", f"limit={args.limit}",
               f"max_new_tokens={args.max_new_tokens}", f"methods={methods}", "dtype=float32",
               "progress=false", "plot=false", f"out={out}", *args.eval_overrides]
        subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads((out / "report.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, metavar="NAME=RUN_DIR")
    ap.add_argument("--prompts", default="tiny_heldout")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--name", default="engine_curve_tiny")
    ap.add_argument("--eval-overrides", nargs="*", default=[])
    args = ap.parse_args()
    work = REPO / "outputs" / "bench" / args.name
    runs = [r.split("=", 1) for r in args.run]
    first_ckpt = str(Path(runs[0][1]) / "checkpoints" / "last.ckpt")
    free = evaluate(work / "model_free", first_ckpt, "[ngram,suffix]", args)
    mf = {k: free["methods"][k] for k in ("ngram", "suffix")}
    best = max(mf, key=lambda k: mf[k]["tokens_per_s"])
    rows = [{"method": "plain (no speculation)", "train CPU min": "-", "steps": "-",
             "tau": 1.0, "tok/s": free["methods"]["baseline"]["tokens_per_s"],
             "x plain": 1.0, f"vs {best}": None, "lossless": True}]
    for k, m in mf.items():
        rows.append({"method": k, "train CPU min": "-", "steps": "-", "tau": m["tau"],
                     "tok/s": m["tokens_per_s"], "x plain": m["speedup"],
                     f"vs {best}": m["tokens_per_s"] / mf[best]["tokens_per_s"],
                     "lossless": free["lossless"]})
    points = []
    for name, run in runs:
        ckpt = str(Path(run) / "checkpoints" / "last.ckpt")
        rep = evaluate(work / name, ckpt, "[chain]", args)
        facts = run_facts(ckpt)
        c = rep["methods"]["chain"]
        # the drafter's tokens/s over the model-free method's, each over plain vLLM measured in
        # its own evaluation (separate engines; the ratio of speedups cancels machine drift)
        vs = c["speedup"] / mf[best]["speedup"]
        minutes = facts.get("train_seconds", 0.0) / 60
        rows.append({"method": f"dflash {name}", "train CPU min": round(minutes, 1),
                     "steps": rep["drafter"].get("global_step"), "tau": c["tau"],
                     "tok/s": c["tokens_per_s"], "x plain": c["speedup"], f"vs {best}": vs,
                     "lossless": rep["lossless"]})
        points.append((name, minutes, vs, c["tau"]))
    payload = {"machine": machine_info(), "prompts": args.prompts, "limit": args.limit,
               "max_new_tokens": args.max_new_tokens, "best_model_free": best, "rows": rows,
               "engine": free["engine"]["version"]}
    table = fmt_table(rows)
    path = write_result(args.name, payload, table)
    _plot(points, best, REPO / "bench" / "results" / f"{args.name}.png")
    print(table)
    print(f"wrote {path}")


def _plot(points: list[tuple[str, float, float, float]], best: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, x, y, tau in points:
        ax.scatter([x], [y])
        ax.annotate(f"{name} (τ {tau:.2f})", (x, y), fontsize=8, xytext=(4, 4),
                    textcoords="offset points")
    ax.axhline(1.0, color="gray", lw=1, label=f"vLLM {best}")
    ax.axhline(1.2, color="gray", lw=1, ls="--", label="goal 1.2x")
    ax.set(xlabel="training time (CPU minutes, sum of step times)",
           ylabel=f"dflash tokens/s / {best} tokens/s (in vLLM)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
