"""Training schedules as pure functions of the global step (nothing to lose on resume)."""

from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, warmup_frac: float, peak: float, final: float) -> float:
    """Linear warm-up from 0 to ``peak`` over ``warmup_frac`` of ``total``, then cosine to ``final``."""
    total = max(int(total), 1)
    warm = int(round(warmup_frac * total))
    if warm > 0 and step < warm:
        return peak * step / warm
    if step >= total:
        return final
    progress = (step - warm) / max(total - warm, 1)
    return final + (peak - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def noise_sigma(step: int, total: int, peak: float, final: float, warmup_frac: float) -> float:
    """Noise σ(step) added to the fc input: warm-up 0 -> peak, then cosine peak -> final."""
    return warmup_cosine(step, total, warmup_frac, peak, final)


def max_anchors_at(step: int, total: int, start: int, end: int, ramp_frac: float) -> int:
    """Anchors per sequence: linear ramp from ``start`` to ``end`` over ``ramp_frac`` of training."""
    if ramp_frac <= 0 or start == end:
        return int(end)
    ramp = max(int(round(ramp_frac * max(total, 1))), 1)
    frac = min(step / ramp, 1.0)
    return max(1, int(round(start + (end - start) * frac)))


def lr_factor(step: int, total: int, warmup_frac: float, min_ratio: float = 0.0) -> float:
    """Multiplier of the base LR: linear warm-up, cosine decay to ``min_ratio``.

    Counts ``step + 1`` during warm-up so the very first optimizer step is not a no-op.
    """
    total = max(int(total), 1)
    warm = int(round(warmup_frac * total))
    if warm > 0 and step < warm:
        return (step + 1) / warm
    return warmup_cosine(step, total, warmup_frac, 1.0, min_ratio)
