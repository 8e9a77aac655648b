"""Gradient-norm statistics per drafter: quantiles, spikes, share of clipped steps."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dflash_lit.analyze.stats import rolling_median


@dataclass
class GradStats:
    drafter: str
    n: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None
    max_step: int | None = None
    clip: float | None = None  # the configured clip norm (None: no clipping configured)
    clipped_share: float | None = None
    clipped_source: str = ""  # "clipped column" | "grad_norm > clip" | ""
    spikes: int = 0  # steps above 5x the rolling median norm
    note: str = ""


def grad_stats(drafter: str, steps: np.ndarray, norm: np.ndarray,
               clipped: np.ndarray | None = None, clip: float | None = None,
               spike_factor: float = 5.0) -> GradStats:
    """Stats of one drafter's pre-clip gradient norm. ``clipped`` (0/1 per step, as logged)
    wins over recomputing ``norm > clip``."""
    norm = np.asarray(norm, dtype=float)
    out = GradStats(drafter=drafter, n=len(norm), clip=clip)
    if len(norm) == 0:
        out.note = "grad_norm not logged"
        return out
    q = np.quantile(norm, [0.5, 0.9, 0.99])
    i = int(np.argmax(norm))
    out.mean, out.p50, out.p90, out.p99 = float(norm.mean()), *map(float, q)
    out.max, out.max_step = float(norm[i]), int(np.asarray(steps)[i])
    if clipped is not None and len(clipped):
        out.clipped_share, out.clipped_source = float(np.mean(np.asarray(clipped) > 0.5)), \
            "clipped column"
    elif clip is not None and math.isfinite(clip):
        out.clipped_share, out.clipped_source = float(np.mean(norm > clip)), "grad_norm > clip"
    base = rolling_median(norm, max(5, min(51, len(norm) // 10 * 2 + 1)))
    out.spikes = int(np.sum(norm > spike_factor * base))
    return out
