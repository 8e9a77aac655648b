"""Jumps across events: epoch boundaries and resumes.

At an event step b, the mean of the ``window`` points logged at or after b is compared with
what a straight line fitted to the ``window`` points before b predicts for them. The excess
is expressed in units of the pre-event residual σ (per-step noise, widened by the trend's
extrapolation error) as a z-score; fewer than ``MIN_FLAG_POINTS`` before the event are
reported but never flagged. A resume
that lost the optimizer state shows up as a loss jump (z > 3) and/or a restarted schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dflash_lit.analyze.logs import ResumeEvent
from dflash_lit.analyze.stats import linear_fit
from dflash_lit.analyze.velocity import direction

MIN_FLAG_POINTS = 5


@dataclass
class Jump:
    metric: str
    step: int
    n_before: int
    n_after: int
    before_mean: float | None = None
    after_mean: float | None = None
    predicted: float | None = None  # after-window mean the pre-event trend predicts
    change: float | None = None  # after_mean − before_mean
    excess: float | None = None  # after_mean − predicted
    sigma: float | None = None  # std of the pre-event residuals around the trend
    z: float | None = None  # excess / (sigma widened by the trend's extrapolation error)
    flagged: bool = False
    note: str = ""


@dataclass
class Continuity:
    """A schedule value (lr, noise, anchors, tokens seen) across a resume."""

    metric: str
    before: float | None
    after: float | None
    predicted: float | None
    flagged: bool = False


@dataclass
class EventCheck:
    kind: str  # epoch | resume
    step: int
    label: str  # "epoch 0 -> 1" or "from <dir>"
    jumps: list[Jump] = field(default_factory=list)
    continuity: list[Continuity] = field(default_factory=list)
    flagged: bool = False
    messages: list[str] = field(default_factory=list)


def default_event_window(n_points: int) -> int:
    """Points on each side of an event: ~1/8 of the run, between 3 and 50."""
    return int(max(3, min(50, n_points // 8)))


def jump_at(steps: np.ndarray, values: np.ndarray, at: int, window: int, metric: str = "",
            z_threshold: float = 3.0, two_sided: bool = True) -> Jump:
    """Excess change of ``values`` across step ``at`` vs the local linear trend before it.

    ``two_sided=False`` flags only a change for the worse (loss up, acc/streak down)."""
    steps, values = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    bi = np.flatnonzero(steps < at)[-window:]
    ai = np.flatnonzero(steps >= at)[:window]
    out = Jump(metric=metric, step=int(at), n_before=len(bi), n_after=len(ai))
    if len(bi) < 3 or len(ai) < 1:
        out.note = f"too few points ({len(bi)} before, {len(ai)} after; need 3 and 1)"
        return out
    a, b, resid = linear_fit(steps[bi], values[bi])
    out.before_mean, out.after_mean = float(values[bi].mean()), float(values[ai].mean())
    out.predicted = float(np.mean(a + b * steps[ai]))
    out.change = out.after_mean - out.before_mean
    out.excess = out.after_mean - out.predicted
    dof = max(len(bi) - 2, 1)
    out.sigma = float(math.sqrt(float((resid ** 2).sum()) / dof))
    # the trend's own extrapolation error (intercept + slope uncertainty at the after steps)
    xb, xa = steps[bi], steps[ai]
    sxx = float(((xb - xb.mean()) ** 2).sum())
    lever = 1 / len(bi) + ((xa.mean() - xb.mean()) ** 2 / sxx if sxx > 0 else 0.0)
    total = out.sigma * math.sqrt(1 + lever)
    scale = max(abs(out.before_mean), 1.0)
    if total > 1e-12 * scale:
        out.z = out.excess / total
    else:  # noise-free data: any visible excess is infinitely significant
        out.z = 0.0 if abs(out.excess) <= 1e-9 * scale else math.copysign(math.inf, out.excess)
    worse = direction(metric) * out.z < 0
    out.flagged = abs(out.z) > z_threshold and (two_sided or worse)
    if len(bi) < MIN_FLAG_POINTS:
        out.flagged = False
        out.note = f"only {len(bi)} points before: not flagged"
    return out


def continuity_at(steps: np.ndarray, values: np.ndarray, at: int, metric: str,
                  window: int = 10, rel_tol: float = 0.02) -> Continuity:
    """Does a schedule continue across ``at``? Linear extrapolation of the last ``window``
    points to the first point after; flagged if off by > 5 σ and > ``rel_tol`` relative."""
    steps, values = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    bi = np.flatnonzero(steps < at)[-window:]
    ai = np.flatnonzero(steps >= at)[:1]
    if len(bi) < 2 or len(ai) < 1:
        return Continuity(metric, None, None, None)
    a, b, resid = linear_fit(steps[bi], values[bi])
    pred = float(a + b * steps[ai[0]])
    after = float(values[ai[0]])
    sigma = float(np.sqrt((resid ** 2).mean())) if len(bi) > 2 else 0.0
    tol = max(5 * sigma, rel_tol * max(abs(pred), abs(float(values[bi[-1]]))), 1e-12)
    return Continuity(metric, float(values[bi[-1]]), after, pred, abs(after - pred) > tol)


def epoch_boundaries(df: pd.DataFrame) -> list[tuple[int, int, int]]:
    """(step, old epoch, new epoch) where the logged ``epoch`` increments."""
    if "epoch" not in df.columns:
        return []
    e = df[["step", "epoch"]].dropna()
    out = []
    prev = None
    for step, ep in zip(e["step"].to_numpy(), e["epoch"].to_numpy()):
        if prev is not None and ep > prev:
            out.append((int(step), int(prev), int(ep)))
        prev = ep
    return out


def _series(df: pd.DataFrame, col: str) -> tuple[np.ndarray, np.ndarray]:
    if col not in df.columns:
        return np.array([]), np.array([])
    v = df[col].to_numpy(dtype=float)
    ok = np.isfinite(v)
    return df["step"].to_numpy()[ok], v[ok]


def check_epochs(df: pd.DataFrame, metrics: list[str], window: int | None = None,
                 z_threshold: float = 3.0) -> list[EventCheck]:
    """Excess change of each metric across each epoch boundary (both directions flagged)."""
    out = []
    for step, old, new in epoch_boundaries(df):
        ev = EventCheck(kind="epoch", step=step, label=f"epoch {old} -> {new}")
        for m in metrics:
            s, v = _series(df, m)
            if len(s) == 0:
                continue
            j = jump_at(s, v, step, window or default_event_window(len(s)), m, z_threshold)
            ev.jumps.append(j)
            if j.flagged:
                ev.flagged = True
                ev.messages.append(f"{m}: change {j.change:+.4g} vs trend-predicted "
                                   f"{j.predicted - j.before_mean:+.4g} (z={j.z:+.1f})")
        out.append(ev)
    return out


SCHEDULE_LEAVES = ("lr", "noise", "anchors")


def check_resume(df: pd.DataFrame, event: ResumeEvent, metrics: list[str],
                 schedules: list[str], window: int | None = None,
                 z_threshold: float = 3.0) -> EventCheck:
    """Regression check at a resume: a jump for the worse in loss/acc/streak beyond
    ``z_threshold`` σ of the pre-resume residuals, or a schedule (lr, noise, anchors, tokens
    seen) that does not continue, says state was lost."""
    ev = EventCheck(kind="resume", step=event.step, label=f"from {event.from_dir}")
    if not event.found:
        ev.messages.append(f"earlier run {event.from_dir} not found: nothing to compare")
        return ev
    for m in metrics:
        s, v = _series(df, m)
        if len(s) == 0:
            continue
        j = jump_at(s, v, event.step, window or default_event_window(len(s)), m,
                    z_threshold, two_sided=False)
        ev.jumps.append(j)
        if j.flagged:
            ev.flagged = True
            ev.messages.append(
                f"REGRESSION {m}: {j.before_mean:.4g} -> {j.after_mean:.4g} across the resume "
                f"(excess {j.excess:+.4g} over trend, z={j.z:+.1f}): optimizer/scheduler state "
                "may not have been restored")
    for m in schedules:
        s, v = _series(df, m)
        if len(s) == 0:
            continue
        c = continuity_at(s, v, event.step, m)
        ev.continuity.append(c)
        if c.flagged:
            ev.flagged = True
            ev.messages.append(f"{m} does not continue across the resume: {c.before:.4g} -> "
                               f"{c.after:.4g} (expected ~{c.predicted:.4g}): a schedule or "
                               "counter restarted")
    return ev
