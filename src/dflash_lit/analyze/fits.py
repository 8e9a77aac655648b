"""Curve fits of a metric over steps and its projection to the final step.

Models (x = step + 1):
  linear   y = a + b·x
  log      y = a + b·ln x
  power    y = a − b·x^(−c)  (saturates at a; c by grid search, a and b by least squares)
  exp      y = a − b·exp(−x/τ)  (saturates faster; τ by grid search over the data's span)

The model with the lowest RMSE on the held-out last 20 % of points (fit on the first 80 %)
is chosen (AIC when there are too few points to hold any out), refit on all points, and its
projection gets a residual-bootstrap 10–90 % interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

C_GRID = np.geomspace(0.02, 3.0, 64)
MIN_POINTS = 8  # below this no model is fitted
MAX_POINTS = 400  # longer series are averaged into this many step bins first
N_PARAMS = {"linear": 2, "log": 2, "power": 3, "exp": 3}
_GRID_KEY = {"power": "c", "exp": "tau"}


@dataclass
class Fit:
    name: str
    params: dict[str, float]
    rmse: float  # on all points
    aic: float
    holdout_rmse: float | None = None  # fit on the first 80 %, error on the last 20 %

    def predict(self, step) -> np.ndarray:
        return predict(self.name, self.params, np.asarray(step, dtype=float))


@dataclass
class Projection:
    metric: str
    final_step: int
    final_step_source: str
    n_points: int
    value: float | None = None
    lo: float | None = None  # 10 % bootstrap quantile
    hi: float | None = None  # 90 %
    chosen: Fit | None = None
    fits: list[Fit] = field(default_factory=list)
    selected_by: str = ""
    note: str = ""
    boot: list[dict[str, float]] = field(default_factory=list, repr=False)  # bootstrap refits


@dataclass
class Reach:
    """First step at which a projection reaches ``goal`` (None: not within ``horizon``)."""

    goal: float
    horizon: float
    step: float | None = None  # the chosen fit's crossing
    lo: float | None = None  # 10 % quantile of the bootstrap refits' crossings
    hi: float | None = None  # 90 % quantile (None: over 10 % of the refits never reach it)
    never: float = 0.0  # share of bootstrap refits that do not reach it within the horizon


def _feature(name: str, x: np.ndarray, g: float | None = None) -> np.ndarray:
    """f(x) of the model y = a + b·f(x) (linear in a, b once the shape g is fixed)."""
    if name == "linear":
        return x
    if name == "log":
        return np.log(x)
    if name == "exp":
        return -np.exp(-x / g)
    return -(x ** -g)


def _ls2(f: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Closed-form least squares of every column of Y on [1, f]: (a, b, SSE) per column."""
    fm = f.mean()
    fc = f - fm
    sff = float(fc @ fc)
    ym = Y.mean(axis=0)
    b = (fc @ Y) / sff if sff > 0 else np.zeros(Y.shape[1])
    a = ym - b * fm
    sse = ((Y - a - np.outer(f, b)) ** 2).sum(axis=0)
    return a, b, sse


def _grid(name: str, x: np.ndarray) -> np.ndarray:
    if name == "power":
        return C_GRID
    span = max(float(x.max() - x.min()), 1.0)
    return np.geomspace(span / 50, span * 5, 64)


def predict(name: str, params: dict[str, float], step: np.ndarray) -> np.ndarray:
    x = np.asarray(step, dtype=float) + 1.0
    if name == "linear":
        return params["a"] + params["b"] * x
    if name == "log":
        return params["a"] + params["b"] * np.log(x)
    if name == "exp":
        return params["a"] - params["b"] * np.exp(-x / params["tau"])
    return params["a"] - params["b"] * x ** -params["c"]


def _solve(name: str, x: np.ndarray, Y: np.ndarray):
    """Least squares for each column of Y; returns (params list per column, SSE per column).

    The saturating models search their shape parameter over a grid (per column)."""
    Y = Y.reshape(len(x), -1)
    if name not in _GRID_KEY:
        a, b, sse = _ls2(_feature(name, x), Y)
        return [{"a": float(a[j]), "b": float(b[j])} for j in range(Y.shape[1])], sse
    best_sse = np.full(Y.shape[1], np.inf)
    best = np.zeros((3, Y.shape[1]))
    for g in _grid(name, x):
        a, b, sse = _ls2(_feature(name, x, g), Y)
        better = sse < best_sse
        best_sse[better] = sse[better]
        best[0, better], best[1, better], best[2, better] = a[better], b[better], g
    key = _GRID_KEY[name]
    params = [{"a": float(best[0, j]), "b": float(best[1, j]), key: float(best[2, j])}
              for j in range(Y.shape[1])]
    return params, best_sse


def fit_model(name: str, steps: np.ndarray, values: np.ndarray) -> Fit:
    x = np.asarray(steps, dtype=float) + 1.0
    y = np.asarray(values, dtype=float)
    params, sse = _solve(name, x, y)
    n, p = len(y), N_PARAMS[name]
    rmse = math.sqrt(float(sse[0]) / n)
    aic = n * math.log(max(float(sse[0]) / n, 1e-300)) + 2 * p
    return Fit(name=name, params=params[0], rmse=rmse, aic=aic)


def bin_series(steps: np.ndarray, values: np.ndarray, max_points: int = MAX_POINTS):
    """Average into at most ``max_points`` equal-width step bins (mean step, mean value)."""
    steps, values = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    if len(steps) <= max_points:
        return steps, values
    edges = np.linspace(steps.min(), steps.max() + 1e-9, max_points + 1)
    idx = np.clip(np.searchsorted(edges, steps, side="right") - 1, 0, max_points - 1)
    cnt = np.bincount(idx, minlength=max_points)
    keep = cnt > 0
    xs = np.bincount(idx, steps, max_points)[keep] / cnt[keep]
    ys = np.bincount(idx, values, max_points)[keep] / cnt[keep]
    return xs, ys


def _clip(metric: str, v: np.ndarray) -> np.ndarray:
    """Keep projections in the metric's range (accuracies in [0, 1], losses ≥ 0)."""
    leaf = metric.rsplit("/", 1)[-1]
    if "acc" in metric:
        return np.clip(v, 0.0, 1.0)
    if "loss" in leaf or "streak" in leaf:
        return np.maximum(v, 0.0)
    return v


def project(steps: np.ndarray, values: np.ndarray, final_step: int, metric: str = "",
            final_step_source: str = "", n_boot: int = 200, seed: int = 0) -> Projection:
    """Fit every model, choose one, and project ``metric`` at ``final_step``."""
    x, y = bin_series(steps, values)
    out = Projection(metric=metric, final_step=int(final_step),
                     final_step_source=final_step_source, n_points=len(x))
    if len(x) < MIN_POINTS:
        out.note = f"too few points to fit ({len(x)} < {MIN_POINTS})"
        return out
    fits = [fit_model(m, x, y) for m in N_PARAMS]
    n_hold = int(round(0.2 * len(x)))
    if n_hold >= 3 and len(x) - n_hold >= MIN_POINTS // 2 + 1:
        for f in fits:
            g = fit_model(f.name, x[:-n_hold], y[:-n_hold])
            err = g.predict(x[-n_hold:]) - y[-n_hold:]
            f.holdout_rmse = math.sqrt(float((err ** 2).mean()))
        chosen = min(fits, key=lambda f: (f.holdout_rmse, N_PARAMS[f.name]))
        out.selected_by = f"held-out RMSE on the last {n_hold} of {len(x)} points"
    else:
        chosen = min(fits, key=lambda f: f.aic)
        out.selected_by = "AIC (too few points to hold out 20 %)"
    out.fits, out.chosen = fits, chosen
    out.value = float(_clip(metric, chosen.predict(np.array([final_step])))[0])
    # residual bootstrap: refit the chosen model on fitted + resampled residuals
    rng = np.random.default_rng(seed)
    fitted = chosen.predict(x)
    resid = y - fitted
    Y = fitted[:, None] + rng.choice(resid, size=(len(x), n_boot), replace=True)
    params, _ = _solve(chosen.name, x + 1.0, Y)
    out.boot = params
    proj = np.array([predict(chosen.name, p, np.array([final_step]))[0] for p in params])
    proj = _clip(metric, proj)
    out.lo, out.hi = float(np.quantile(proj, 0.1)), float(np.quantile(proj, 0.9))
    last = float(np.max(steps))
    if final_step > 3 * max(last, 1):
        out.note = f"extrapolates {final_step / max(last, 1):.1f}x beyond the last step: rough"
    elif final_step <= last:
        out.note = "final step already reached: the fit's value there"
    return out


def first_crossing(name: str, params: dict[str, float], goal: float, start: float,
                   horizon: float, n_grid: int = 4000) -> float:
    """First step in [``start``, ``horizon``] at which model ``name`` with ``params`` reaches
    ``goal`` (inf: not within the horizon), on a geometric grid (exact to
    ~``log(horizon/start)/n_grid`` relative)."""
    grid = np.geomspace(max(float(start), 1.0), float(horizon), n_grid)
    hit = np.nonzero(predict(name, params, grid) >= goal)[0]
    return float(grid[hit[0]]) if len(hit) else math.inf


def steps_to_reach(pr: Projection, goal: float, start: float, horizon: float) -> Reach:
    """The first step in [``start``, ``horizon``] at which ``pr``'s chosen fit, and each of its
    bootstrap refits, reach ``goal`` (a metric that should rise, e.g. τ or accuracy), with the
    refits' 10-90 % band."""
    out = Reach(goal=float(goal), horizon=float(horizon))
    if pr.chosen is None:
        return out
    name = pr.chosen.name
    step = first_crossing(name, pr.chosen.params, goal, start, horizon)
    out.step = None if math.isinf(step) else step
    crossings = np.array([first_crossing(name, p, goal, start, horizon) for p in pr.boot]
                         or [step])
    out.never = float(np.isinf(crossings).mean())
    lo, hi = (float(np.quantile(crossings, q, method="inverted_cdf")) for q in (0.1, 0.9))
    out.lo = None if math.isinf(lo) else lo
    out.hi = None if math.isinf(hi) else hi
    return out
