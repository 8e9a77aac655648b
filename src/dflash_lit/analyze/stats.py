"""Small numpy statistics shared by the analyses (no scipy: numpy + pandas only)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd


def rolling_median(values: np.ndarray, window: int) -> np.ndarray:
    """Centred rolling median (shorter windows at the ends)."""
    return (pd.Series(np.asarray(values, dtype=float))
            .rolling(max(int(window), 1), center=True, min_periods=1).median().to_numpy())


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Centred rolling mean (shorter windows at the ends): the curve drawn over noisy steps."""
    return (pd.Series(np.asarray(values, dtype=float))
            .rolling(max(int(window), 1), center=True, min_periods=1).mean().to_numpy())


def default_window(n: int, frac: float = 0.05, lo: int = 5, hi: int = 201) -> int:
    """An odd window of about ``frac`` of ``n`` points, clamped to [lo, hi]."""
    w = int(min(max(round(n * frac), lo), hi))
    return w + 1 if w % 2 == 0 else w


def detrend(values: np.ndarray, window: int | None = None) -> np.ndarray:
    """Residuals against a centred rolling median: per-batch scatter with the trend removed."""
    values = np.asarray(values, dtype=float)
    return values - rolling_median(values, window or default_window(len(values)))


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (1-based)."""
    return pd.Series(np.asarray(x, dtype=float)).rank(method="average").to_numpy()


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 3:
        return math.nan
    xc, yc = x - x.mean(), y - y.mean()
    den = math.sqrt(float((xc * xc).sum() * (yc * yc).sum()))
    return float((xc * yc).sum() / den) if den > 0 else math.nan


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(ranks(x), ranks(y))


def corr_pvalue(r: float, n: int) -> float:
    """Two-sided p-value of a correlation via Fisher's z (normal approximation, n > 3)."""
    if not math.isfinite(r) or n <= 3:
        return math.nan
    r = min(max(r, -0.999999), 0.999999)
    z = math.atanh(r) * math.sqrt(n - 3)
    return math.erfc(abs(z) / math.sqrt(2))


def linear_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, np.ndarray]:
    """Least-squares ``y = a + b x``; returns (a, b, residuals). Constant x → slope 0."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) == 0:
        return math.nan, math.nan, np.array([])
    xm = x.mean()
    sxx = float(((x - xm) ** 2).sum())
    b = float(((x - xm) * (y - y.mean())).sum() / sxx) if sxx > 0 else 0.0
    a = float(y.mean() - b * xm)
    return a, b, y - (a + b * x)


def robust_sigma(x: np.ndarray) -> float:
    """1.4826 × median absolute deviation: a standard deviation that ignores outliers."""
    x = np.asarray(x, dtype=float)
    return float(1.4826 * np.median(np.abs(x - np.median(x)))) if len(x) else math.nan


def finite_or_none(v):
    """JSON-friendly number: NaN/inf → None, numpy scalars → Python."""
    if v is None:
        return None
    if isinstance(v, np.integer | int) and not isinstance(v, bool):
        return int(v)
    if isinstance(v, np.floating | float):
        return float(v) if math.isfinite(float(v)) else None
    return v
