"""Multi-drafter: wall time per step of 1, 2, 3 drafters sharing one target forward vs the
same drafters trained in separate runs (N × the 1-drafter step), on a random target deeper
than the drafter (hidden 256, 24 layers) so the target forward's share is visible.

    python bench/multi_drafter.py [--steps 3]
"""

from __future__ import annotations

import argparse

from common import fmt_table, peaks, write_result
from steps import time_steps

TARGET = ["target=random_qwen3", "target.build.vocab_size=4096", "target.build.hidden_size=256",
          "target.build.num_layers=24", "+target.build.intermediate_size=1024",
          "+target.build.head_dim=64", "target.mask_token_id=1"]
SETS = {1: ["drafters=single"], 2: ["drafters=gamma_sweep", "~drafters.gamma10"],
        3: ["drafters=gamma_sweep"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    pk = peaks()
    res = {}
    for n, ov in SETS.items():
        res[n] = time_steps(["experiment=v5_hardce", *TARGET, *ov], steps=args.steps)
        print(n, res[n], flush=True)
    one = res[1]["step_s"]
    rows = [{
        "drafters": n, "shared_step_s": r["step_s"], "separate_step_s": n * one,
        "separate_over_shared": n * one / r["step_s"],
        "target_fwd_share": r["target_fwd"] / r["step_s"],
        "target_params_M": r["target_params"] / 1e6, "drafter_params_M": r["drafter_params"] / 1e6,
    } for n, r in res.items()]
    table = fmt_table(rows)
    write_result("multi_drafter", {"peaks": pk, "rows": rows, "raw": res}, table)


if __name__ == "__main__":
    main()
