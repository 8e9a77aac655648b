"""Improvement velocity: how much a metric moves per k steps, segment by segment, and how
fast that velocity decays (is the run still learning, slowing down, or flat?)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MIN_PER_SEGMENT = 4


def direction(metric: str) -> int:
    """+1 when larger is better (acc, streak, acc_pos, τ), -1 for losses."""
    return -1 if "loss" in metric.rsplit("/", 1)[-1] else 1


@dataclass
class Segment:
    """Steps ``[start, end)``; ``velocity`` = change of the mean vs the previous segment,
    scaled to k steps (centres ``k`` apart for full, evenly logged segments)."""

    index: int
    start: int
    end: int
    n: int
    center: float
    mean: float
    std: float
    velocity: float | None = None
    velocity_se: float | None = None
    ratio: float | None = None  # velocity / previous velocity (velocity decay)


@dataclass
class Velocity:
    metric: str
    k: int
    segments: list[Segment] = field(default_factory=list)
    decay_per_k: float | None = None  # fitted factor the improvement rate keeps per k steps
    half_life_steps: float | None = None  # steps for the improvement rate to halve
    decay_note: str = ""
    trend: str = "too few points"  # still improving | slowing | plateaued | getting worse

    @property
    def velocities(self) -> list[float]:
        return [s.velocity for s in self.segments[1:]]


def make_segments(steps: np.ndarray, values: np.ndarray, k: int | None = None,
                  n_segments: int = 8) -> tuple[int, list[Segment]]:
    """Split the logged range into consecutive k-step windows (default: ~``n_segments``).

    A trailing window with under half the usual number of points is merged into the one
    before it (a lone last point would otherwise dominate the last velocity).
    """
    steps, values = np.asarray(steps), np.asarray(values, dtype=float)
    if len(steps) == 0:
        return int(k or 1), []
    s0, s1 = int(steps.min()), int(steps.max())
    if k is None:  # at least MIN_PER_SEGMENT points per segment, so each mean has a spread
        n_seg = max(2, min(n_segments, len(steps) // MIN_PER_SEGMENT))
        k = max(1, math.ceil((s1 - s0 + 1) / n_seg))
    k = int(k)
    idx = (steps - s0) // k
    groups = [np.flatnonzero(idx == i) for i in np.unique(idx)]
    if len(groups) >= 2:
        typical = np.median([len(g) for g in groups[:-1]])
        if len(groups[-1]) < 0.5 * typical:
            groups = groups[:-2] + [np.concatenate(groups[-2:])]
    segs = []
    for i, g in enumerate(groups):
        v = values[g]
        start = s0 + int(idx[g[0]]) * k
        end = s0 + (int(idx[g[-1]]) + 1) * k
        segs.append(Segment(index=i, start=start, end=end, n=len(g),
                            center=float(steps[g].mean()), mean=float(v.mean()),
                            std=float(v.std(ddof=1)) if len(g) > 1 else math.nan))
    return k, segs


def segment_velocity(steps: np.ndarray, values: np.ndarray, metric: str = "",
                     k: int | None = None, n_segments: int = 8) -> Velocity:
    """Velocity per segment (from segment means: a k-step boxcar smoother), its decay, and a
    one-word trend for the latest segment."""
    k, segs = make_segments(steps, values, k, n_segments)
    out = Velocity(metric=metric, k=k, segments=segs)
    # a one-point segment has no spread of its own: use the pooled within-segment spread
    spreads = [s.std ** 2 for s in segs if math.isfinite(s.std)]
    pooled = math.sqrt(sum(spreads) / len(spreads)) if spreads else math.nan
    for prev, cur in zip(segs, segs[1:]):
        gap = cur.center - prev.center
        scale = k / gap if gap > 0 else math.nan
        cur.velocity = (cur.mean - prev.mean) * scale
        var = sum((s.std if math.isfinite(s.std) else pooled) ** 2 / s.n for s in (prev, cur))
        cur.velocity_se = math.sqrt(var) * scale if math.isfinite(var) else None
        if prev.velocity is not None and prev.velocity != 0:
            cur.ratio = cur.velocity / prev.velocity
    if len(segs) < 3:
        out.decay_note = f"{len(segs)} segment(s): too few to measure a velocity trend"
        return out
    sign = direction(metric)
    _fit_decay(out, sign)
    u = [sign * s.velocity for s in segs[1:]]
    if segs[-1].velocity_se is None:
        out.decay_note += "; no spread within segments: trend not judged"
        return out
    last, se = u[-1], segs[-1].velocity_se
    peak = max(u)
    if last < -2 * se and last < 0:
        out.trend = "getting worse"
    elif last > 2 * se and last > 0:
        out.trend = "still improving" if last >= 0.25 * peak else "slowing"
    else:
        out.trend = "plateaued"
    return out


def _fit_decay(out: Velocity, sign: int) -> None:
    """Fit log(improvement rate) linear in step over the segments that improved."""
    pts = [(s.center, sign * s.velocity) for s in out.segments[1:] if sign * s.velocity > 0]
    if len(pts) < 3:
        out.decay_note = (f"only {len(pts)} improving segment(s): too few to fit a decay rate")
        return
    c = np.array([p[0] for p in pts])
    logu = np.log([p[1] for p in pts])
    beta = float(np.polyfit(c, logu, 1)[0])
    out.decay_per_k = math.exp(beta * out.k)
    if beta < 0:
        out.half_life_steps = math.log(2) / -beta
        out.decay_note = (f"improvement rate x{out.decay_per_k:.3g} per {out.k} steps "
                          f"(halves every {out.half_life_steps:.0f} steps)")
    else:
        out.decay_note = f"improvement rate not decaying (x{out.decay_per_k:.3g} per {out.k} steps)"
