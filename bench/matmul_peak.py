"""Ceiling: this machine's matmul peak (fp32, bf16), the denominator of every MFU figure.

    python bench/matmul_peak.py [--n 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch
from common import fmt_table, matmul_peak, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for n in args.sizes:
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            rows.append({"dtype": name, "n": n, "gflops": matmul_peak(dt, n, args.repeats)})
    best = {d: max(r["gflops"] for r in rows if r["dtype"] == d) for d in ("fp32", "bf16")}
    table = fmt_table(rows) + f"\n\npeak: fp32 {best['fp32']:.1f} GFLOP/s, bf16 {best['bf16']:.1f} GFLOP/s"
    write_result("matmul_peak", {"rows": rows, "peak_gflops": best}, table)


if __name__ == "__main__":
    main()
