"""The target's greedy labels in bf16 against float32: how often they agree, and how much faster
the bf16 forward is (what ``features.target_dtype=bfloat16`` trades).

Runs the target in both dtypes over the first ``--rows`` rows of a regenerated shard dir, one
row at a time, and compares the argmax at every completion position (where the drafter is
trained: ``loss_mask`` of the next token). Speed is the ratio of the two forwards' wall time
measured in the same run.

    python bench/label_dtype.py [--target ~/.cache/dflash-lit/smollm2]
                                [--data artifacts/smollm2/data/val] [--rows 24]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import REPO, fmt_table, write_result

from dflash_lit.data.shards import find_shards
from dflash_lit.paths import repo_relative


def main() -> None:
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    from dflash_lit.targets.smollm2 import default_dir

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=default_dir())
    ap.add_argument("--data", type=Path, default=REPO / "artifacts" / "smollm2" / "data" / "val")
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--name", default="label_dtype_smollm2")
    args = ap.parse_args()
    rows = pq.read_table(find_shards(str(args.data))[0]).to_pylist()[:args.rows]
    models = {dt: AutoModelForCausalLM.from_pretrained(args.target, torch_dtype=dt).eval()
              for dt in (torch.float32, torch.bfloat16)}
    seconds = dict.fromkeys(models, 0.0)
    agree = total = 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["input_ids"]])
            arg = {}
            for dt, m in models.items():
                t0 = time.perf_counter()
                arg[dt] = m(ids).logits[0, :-1].argmax(-1)
                seconds[dt] += time.perf_counter() - t0
            sel = torch.tensor(r["loss_mask"][1:]).bool()  # position i predicts token i+1
            agree += int((arg[torch.float32][sel] == arg[torch.bfloat16][sel]).sum())
            total += int(sel.sum())
    result = {"rows": len(rows), "positions": total, "agreement": agree / total,
              "fp32_s": seconds[torch.float32], "bf16_s": seconds[torch.bfloat16],
              "bf16_speedup": seconds[torch.float32] / seconds[torch.bfloat16]}
    table = fmt_table([result]) + (f"\n\n{repo_relative(str(args.data))}, first {len(rows)} rows, one row per "
                                   "forward; agreement = share of completion positions whose "
                                   "argmax is the same in both dtypes\n")
    write_result(args.name, {"target": "smollm2" if args.target == default_dir()
                             else repo_relative(str(args.target)), **result}, table)


if __name__ == "__main__":
    main()
