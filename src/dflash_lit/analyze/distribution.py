"""Per-batch loss distribution: histogram, tail shares, bimodality (1- vs 2-component
Gaussian mixture by EM, compared by BIC) and what the per-batch scatter correlates with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dflash_lit.analyze.stats import (
    corr_pvalue,
    default_window,
    pearson,
    robust_sigma,
    rolling_median,
    spearman,
)

_LOG2PI = math.log(2 * math.pi)


@dataclass
class Mixture:
    """A fitted 1- or 2-component Gaussian mixture (components sorted by mean)."""

    weights: list[float]
    means: list[float]
    stds: list[float]
    loglik: float
    bic: float
    iterations: int = 0


@dataclass
class Bimodality:
    one: Mixture
    two: Mixture
    delta_bic: float  # BIC(1) − BIC(2): > 0 favours two components
    separation: float  # Ashman's D = |μ1 − μ2| √2 / √(σ1² + σ2²); > 2 means separated modes
    verdict: str  # bimodal | unimodal | skewed or heavy-tailed (not two separated modes)


@dataclass
class Correlation:
    against: str
    n: int
    pearson: float | None = None
    spearman: float | None = None
    p_pearson: float | None = None
    note: str = ""


@dataclass
class LossDistribution:
    metric: str
    n: int
    skipped_warmup: int
    values: np.ndarray = field(repr=False)  # detrended, level restored (trend removed)
    raw: np.ndarray = field(repr=False)
    steps: np.ndarray = field(repr=False)
    window: int = 0
    quantiles: dict[str, float] = field(default_factory=dict)
    thresholds: tuple[float, float] = (math.nan, math.nan)
    threshold_rule: str = ""
    share_below: float = math.nan
    share_above: float = math.nan
    hist_counts: list[int] = field(default_factory=list)
    hist_edges: list[float] = field(default_factory=list)
    bimodality: Bimodality | None = None
    correlations: list[Correlation] = field(default_factory=list)
    note: str = ""


# ----------------------------------------------------------------------------- mixtures
def _normal_logpdf(x: np.ndarray, mu: float, sd: float) -> np.ndarray:
    return -0.5 * (((x - mu) / sd) ** 2 + _LOG2PI) - math.log(sd)


def fit_gaussian(x: np.ndarray) -> Mixture:
    x = np.asarray(x, dtype=float)
    mu, sd = float(x.mean()), max(float(x.std()), 1e-12)
    ll = float(_normal_logpdf(x, mu, sd).sum())
    return Mixture([1.0], [mu], [sd], ll, -2 * ll + 2 * math.log(len(x)))


def _em(x: np.ndarray, mu: np.ndarray, sd: np.ndarray, w: np.ndarray, floor: float,
        iters: int, tol: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, int]:
    ll_old, it = -math.inf, 0
    while it < iters:
        it += 1
        logp = np.stack([np.log(w[j]) + _normal_logpdf(x, mu[j], sd[j]) for j in range(2)])
        top = logp.max(axis=0)
        lse = top + np.log(np.exp(logp - top).sum(axis=0))
        ll = float(lse.sum())
        r = np.exp(logp - lse)
        nk = r.sum(axis=1) + 1e-300
        w = nk / len(x)
        mu = (r * x).sum(axis=1) / nk
        sd = np.sqrt(np.maximum((r * (x - mu[:, None]) ** 2).sum(axis=1) / nk, floor ** 2))
        if abs(ll - ll_old) < tol * max(1.0, abs(ll)):
            break
        ll_old = ll
    logp = np.stack([np.log(w[j]) + _normal_logpdf(x, mu[j], sd[j]) for j in range(2)])
    top = logp.max(axis=0)
    ll = float((top + np.log(np.exp(logp - top).sum(axis=0))).sum())
    return mu, sd, w, ll, it


def fit_mixture2(x: np.ndarray, iters: int = 500, tol: float = 1e-10) -> Mixture:
    """Two-component Gaussian mixture by EM from deterministic starts (quantile pairs); the
    start with the best likelihood wins. A std floor keeps a component from collapsing."""
    x = np.asarray(x, dtype=float)
    spread = max(float(x.std()), 1e-12)
    floor = 1e-3 * spread
    best = None
    for lo, hi in ((0.25, 0.75), (0.1, 0.9), (0.05, 0.5), (0.5, 0.95)):
        mu0 = np.quantile(x, [lo, hi]).astype(float)
        if mu0[1] - mu0[0] < 1e-9 * spread:
            mu0[1] = mu0[0] + spread
        sd0 = np.full(2, spread / 2)
        res = _em(x, mu0, sd0, np.array([0.5, 0.5]), floor, iters, tol)
        if best is None or res[3] > best[3]:
            best = res
    mu, sd, w, ll, it = best
    order = np.argsort(mu)
    return Mixture([float(w[i]) for i in order], [float(mu[i]) for i in order],
                   [float(sd[i]) for i in order], ll, -2 * ll + 5 * math.log(len(x)), it)


def bimodality(x: np.ndarray, min_delta_bic: float = 10.0, min_separation: float = 2.0,
               min_weight: float = 0.05) -> Bimodality:
    """Compare 1 vs 2 Gaussians. "bimodal" needs ΔBIC > ``min_delta_bic`` *and* two separated
    modes (Ashman's D > ``min_separation``, lighter weight ≥ ``min_weight``): a skewed
    unimodal loss also prefers 2 components by BIC, but with overlapping ones."""
    one, two = fit_gaussian(x), fit_mixture2(x)
    d = abs(two.means[1] - two.means[0]) * math.sqrt(2) / math.sqrt(
        two.stds[0] ** 2 + two.stds[1] ** 2)
    delta = one.bic - two.bic
    if delta <= min_delta_bic:
        verdict = "unimodal"
    elif d > min_separation and min(two.weights) >= min_weight:
        verdict = "bimodal"
    else:
        verdict = "skewed or heavy-tailed (not two separated modes)"
    return Bimodality(one, two, float(delta), float(d), verdict)


# ----------------------------------------------------------------------------- the analysis
def correlate(resid: np.ndarray, other: np.ndarray, name: str) -> Correlation:
    ok = np.isfinite(resid) & np.isfinite(other)
    n = int(ok.sum())
    if n < 5:
        return Correlation(name, n, note=f"only {n} steps with both logged")
    if np.ptp(other[ok]) == 0:
        return Correlation(name, n, note="constant over the analysed steps")
    r = pearson(resid[ok], other[ok])
    return Correlation(name, n, r, spearman(resid[ok], other[ok]), corr_pvalue(r, n))


def loss_distribution(steps: np.ndarray, loss: np.ndarray, metric: str = "loss",
                      covariates: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                      skip_frac: float = 0.1, thresholds: tuple[float, float] | None = None,
                      window: int | None = None, bins: int = 40) -> LossDistribution:
    """Distribution of the per-batch loss after the first ``skip_frac`` of the steps.

    The loss is detrended against a centred rolling median (``window`` points) and shifted
    back to its median level, so shares, quantiles and the mixture describe batch-to-batch
    scatter, not the learning curve. ``covariates``: name → (steps, values) correlated with
    the detrended residual (Pearson and Spearman). Default thresholds: median ± 2 robust σ.
    """
    steps, loss = np.asarray(steps), np.asarray(loss, dtype=float)
    cut = int(math.floor(skip_frac * len(steps)))
    s, raw = steps[cut:], loss[cut:]
    out = LossDistribution(metric=metric, n=len(raw), skipped_warmup=cut, values=raw.copy(),
                           raw=raw, steps=s)
    if len(raw) < 10:
        out.note = f"too few steps after warm-up ({len(raw)} < 10)"
        return out
    out.window = int(window or default_window(len(raw)))
    trend = rolling_median(raw, out.window)
    resid = raw - trend
    vals = resid + float(np.median(raw))
    out.values = vals
    q = np.quantile(vals, [0.05, 0.25, 0.5, 0.75, 0.95])
    out.quantiles = {f"p{p}": float(v) for p, v in zip((5, 25, 50, 75, 95), q)}
    med, rs = float(q[2]), robust_sigma(vals)
    if thresholds is None:
        out.thresholds, out.threshold_rule = (med - 2 * rs, med + 2 * rs), "median ± 2 robust σ"
    else:
        out.thresholds, out.threshold_rule = (float(thresholds[0]), float(thresholds[1])), "given"
    out.share_below = float((vals < out.thresholds[0]).mean())
    out.share_above = float((vals > out.thresholds[1]).mean())
    counts, edges = np.histogram(vals, bins=bins)
    out.hist_counts, out.hist_edges = counts.tolist(), edges.tolist()
    out.bimodality = bimodality(vals)
    for name, (cs, cv) in (covariates or {}).items():
        aligned = _align(s, np.asarray(cs), np.asarray(cv, dtype=float))
        out.correlations.append(correlate(resid, aligned, name))
    return out


def _align(steps: np.ndarray, other_steps: np.ndarray, other: np.ndarray) -> np.ndarray:
    """``other`` at ``steps`` (NaN where it was not logged at that exact step)."""
    out = np.full(len(steps), np.nan)
    if len(other_steps) == 0:
        return out
    order = np.argsort(other_steps)
    os_, ov = other_steps[order], other[order]
    i = np.clip(np.searchsorted(os_, steps), 0, len(os_) - 1)
    hit = os_[i] == steps
    out[hit] = ov[i[hit]]
    return out
