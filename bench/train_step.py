"""Training step: tokens/s, achieved FLOP/s (analytic count, see flops.py) and its fraction of
this machine's matmul peak, with the time split into data, target forward, drafter forward,
backward and optimizer — for the default tiny setup and a larger drafter on a wider target.

    python bench/train_step.py [--steps 4]
"""

from __future__ import annotations

import argparse

from common import fmt_table, peaks, write_result
from steps import PHASES, time_steps

SETUPS = {
    # the embedded default: tiny target (hidden 256, 8 layers), 1-layer drafter, 32 anchors
    "default v5 (d=256, 1 layer)": ["experiment=v5_hardce"],
    # a wider random target (hidden 512) and a 2-layer drafter with 8 heads, SwiGLU 1536
    "large (d=512, 2 layers)": [
        "experiment=v5_hardce", "target=random_qwen3", "target.build.vocab_size=4096",
        "target.build.hidden_size=512", "+target.build.intermediate_size=1536",
        "+target.build.num_attention_heads=8", "+target.build.num_key_value_heads=4",
        "+target.build.head_dim=64", "target.mask_token_id=1",
        "drafter.num_hidden_layers=2", "drafter.num_attention_heads=8",
        "drafter.num_key_value_heads=4", "drafter.intermediate_size=1536",
    ],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--setups", nargs="+", default=list(SETUPS))
    args = ap.parse_args()
    pk = peaks()
    rows = []
    for name in args.setups:
        m = time_steps(SETUPS[name], steps=args.steps)
        flops = m["drafter_flops"] + m["target_flops"]
        row = {
            "setup": name, "drafter_params_M": m["drafter_params"] / 1e6,
            "step_s": m["step_s"], "target_tok_s": m["target_tokens"] / m["step_s"],
            "block_tok_s": m["block_tokens"] / m["step_s"],
            "model_gflops": flops / m["step_s"] / 1e9,
            "mfu_fp32": flops / m["step_s"] / 1e9 / pk["fp32_gflops"],
        }
        row.update({f"{p}_%": 100 * m[p] / m["step_s"] for p in PHASES})
        rows.append(row)
        print(row, flush=True)
    table = fmt_table(rows) + (f"\n\nmatmul peak (same run): fp32 {pk['fp32_gflops']:.1f} "
                               f"GFLOP/s, bf16 {pk['bf16_gflops']:.1f} GFLOP/s")
    write_result("train_step", {"peaks": pk, "rows": rows}, table)


if __name__ == "__main__":
    main()
