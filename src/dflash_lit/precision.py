"""Pick fp32 or bf16 for CPU training by measuring this machine, not by assuming.

bf16 matmuls are 2-4x faster than fp32 on CPUs with AVX512-BF16/AMX and up to ~100x
*slower* on AVX2-only CPUs (no native bf16: every product goes through a conversion path).
``cpu_precision()`` times a small matmul both ways once per process and answers Lightning's
precision string; ``conf/trainer/cpu.yaml`` uses it as ``precision: ${cpu_precision:}``.
"""

from __future__ import annotations

import functools
import time

import torch

BF16_MIN_SPEEDUP = 1.3  # bf16 must beat fp32 by this much to be worth its rounding


def _matmul_seconds(dtype: torch.dtype, n: int = 512, k: int = 256, repeats: int = 3) -> float:
    a, b = torch.randn(n, k, dtype=dtype), torch.randn(k, k, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=1)
def bf16_speedup() -> float:
    """fp32 time / bf16 time of a [512, 256] @ [256, 256] matmul on this CPU (best of 3)."""
    return _matmul_seconds(torch.float32) / _matmul_seconds(torch.bfloat16)


def cpu_precision() -> str:
    """``bf16-mixed`` where bf16 matmuls measure >= 1.3x faster than fp32 here, else ``32-true``."""
    return "bf16-mixed" if bf16_speedup() >= BF16_MIN_SPEEDUP else "32-true"


def head_dtype(precision: str) -> torch.dtype | None:
    """The fused lm_head's matmul dtype for a Lightning precision string (None = fp32)."""
    return torch.bfloat16 if str(precision).startswith("bf16") else None
