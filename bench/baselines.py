"""A drafter against the model-free baselines users have, by real speculative decoding.

    python bench/baselines.py --ckpt outputs/<run>/checkpoints/last.ckpt --prompts tiny_heldout
    python bench/baselines.py --ckpt DIR --prompts humaneval --name baselines_smollm2 \
        --eval-overrides target=smollm2 dtype=bfloat16

Runs ``evaluate.py`` once with every method (drafter chain and DDTree, n-gram with vLLM's
rule, suffix decoding as vLLM runs it, the project's tree-shaped suffix decoding, the two
drafter + suffix hybrids) and once more for n-gram with the
earlier "latest occurrence" rule, on one prompt set (lossless checked), and writes
``bench/results/<name>.{json,md}``: τ and tokens/s per method, each against the strongest
model-free method of the same run. An evaluation already written is read back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import REPO, fmt_table, write_result

METHODS = "[chain,tree,ngram,suffix,suffix_tree,hybrid,merged,baseline]"


def evaluate(out: Path, ckpt: str, prompts: str, limit: int, max_new: int, budget: int,
             extra: list[str]) -> dict:
    """One evaluate.py run into ``out`` (read back when its report exists)."""
    if not (out / "report.json").is_file():
        cmd = [sys.executable, str(REPO / "evaluate.py"), f"ckpt={ckpt}", f"prompts={prompts}",
               f"limit={limit}", f"max_new_tokens={max_new}", f"budgets=[{budget}]",
               "progress=false", f"out={out}", *extra]
        subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads((out / "report.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="training .ckpt or z-lab drafter directory")
    ap.add_argument("--prompts", default="tiny_heldout", help="evaluate.py prompt set")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=16, help="DDTree / hybrid node budget")
    ap.add_argument("--name", default=None, help="result name (default baselines_<prompts>)")
    ap.add_argument("--eval-overrides", nargs="*", default=[], help="extra evaluate.py overrides")
    ap.add_argument("--methods", default=METHODS, help=f"evaluate.py methods (default {METHODS})")
    ap.add_argument("--no-latest-rule", action="store_true",
                    help="skip the second run, n-gram with the 'latest occurrence' rule")
    args = ap.parse_args()
    name = args.name or f"baselines_{args.prompts}"
    work = REPO / "outputs" / "bench" / name
    common = (args.ckpt, args.prompts, args.limit, args.max_new_tokens, args.budget)
    rep = evaluate(work / "all", *common, [f"methods={args.methods}", *args.eval_overrides])
    methods, lossless = dict(rep["methods"]), rep["lossless"]
    if not args.no_latest_rule:
        old = evaluate(work / "ngram_latest", *common,
                       ["methods=[ngram,baseline]", "ngram.rule=latest", *args.eval_overrides])
        methods["ngram (latest rule)"] = old["methods"]["ngram"]
        lossless = lossless and old["lossless"]
    best = rep["best_model_free"]
    ref = methods[best]
    rows = []
    for k, m in methods.items():
        if k == "baseline":
            rows.append({"method": "target alone", "tau": 1.0, "tokens_per_s": m["tokens_per_s"],
                         "speedup": 1.0, "tau_vs_best": None, "tps_vs_best": None})
            continue
        rows.append({"method": k, "tau": m["tau"], "tokens_per_s": m["tokens_per_s"],
                     "speedup": m["speedup"], "tau_vs_best": m["tau"] / ref["tau"],
                     "tps_vs_best": m["tokens_per_s"] / ref["tokens_per_s"]})
    table = fmt_table(rows) + (
        f"\n\n{args.prompts}, first {args.limit} prompts x {args.max_new_tokens} tokens, "
        f"budget {args.budget}, lossless={lossless}; strongest model-free method (tokens/s): "
        f"**{best}**; *_vs_best are ratios to it measured in the same run")
    write_result(name, {"ckpt": args.ckpt, "prompts": args.prompts, "limit": args.limit,
                        "max_new_tokens": args.max_new_tokens, "budget": args.budget,
                        "lossless": lossless, "best_model_free": best, "rows": rows,
                        "eval_overrides": args.eval_overrides}, table)


if __name__ == "__main__":
    main()
