"""Figures of the analyses. Each function returns a ``matplotlib.figure.Figure`` built without
pyplot (no global state; works under Agg in the CLI and inline in notebooks)."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure

from dflash_lit.analyze.compare import TOKENS, aligned
from dflash_lit.analyze.distribution import LossDistribution
from dflash_lit.analyze.fits import Projection
from dflash_lit.analyze.grads import GradStats
from dflash_lit.analyze.logs import Run
from dflash_lit.analyze.stats import default_window, detrend, smooth
from dflash_lit.analyze.velocity import Velocity

LEAVES = ("loss", "acc", "streak")


def _events(ax, run: Run, epochs: list[int] | None) -> None:
    for i, s in enumerate(epochs or []):
        ax.axvline(s, color="0.6", ls=":", lw=1, label="epoch" if i == 0 else None)
    for i, ev in enumerate(run.resumes):
        ax.axvline(ev.step, color="tab:red", ls="--", lw=1, label="resume" if i == 0 else None)


def _legend(ax, **kw) -> None:
    """A legend only when something carries a label (no matplotlib warning otherwise)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def _colors(n: int):
    return [f"C{i % 10}" for i in range(n)]


def plot_metrics(run: Run, epochs: list[int] | None = None) -> Figure:
    """Train loss/acc/streak per drafter (raw faint, smoothed solid) with val points."""
    fig = Figure(figsize=(11, 8.5), layout="constrained")
    axes = fig.subplots(len(LEAVES), 1, sharex=True)
    for ax, leaf in zip(axes, LEAVES):
        for d, c in zip(run.drafters, _colors(len(run.drafters))):
            s, v = run.series(f"train/{d}/{leaf}")
            if len(s):
                ax.plot(s, v, color=c, alpha=0.2, lw=0.8)
                ax.plot(s, smooth(v, default_window(len(v))), color=c, lw=1.8,
                        label=f"{d} train")
            vs, vv = run.series(f"val/{d}/{leaf}")
            if len(vs):
                ax.plot(vs, vv, "o--", color=c, ms=5, lw=1, label=f"{d} val")
        _events(ax, run, epochs)
        ax.set_ylabel(leaf)
        ax.grid(alpha=0.3)
        if leaf == "loss":
            _legend(ax, fontsize=8, ncol=3)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"{run.name}: training curves")
    return fig


def plot_velocity(run: Run, velocity: dict[str, dict[str, Velocity]],
                  projection: dict[str, dict[str, Projection]]) -> Figure:
    """Left: smoothed curve, chosen fit and projection (10–90 % bar). Right: Δ per k steps."""
    fig = Figure(figsize=(12, 9), layout="constrained")
    axes = fig.subplots(len(LEAVES), 2, squeeze=False)
    for row, leaf in enumerate(LEAVES):
        axf, axv = axes[row]
        n = max(len(run.drafters), 1)
        for j, (d, c) in enumerate(zip(run.drafters, _colors(n))):
            s, v = run.series(f"train/{d}/{leaf}")
            if not len(s):
                continue
            axf.plot(s, smooth(v, default_window(len(v))), color=c, lw=1.2, label=d)
            p = projection.get(d, {}).get(leaf)
            if p is not None and p.chosen is not None:
                xs = np.linspace(s.min(), max(p.final_step, s.max()), 200)
                axf.plot(xs, p.chosen.predict(xs), color=c, ls="--", lw=1,
                         label=f"{d} {p.chosen.name} fit")
                axf.errorbar([p.final_step], [p.value], yerr=[[p.value - p.lo], [p.hi - p.value]],
                             fmt="s", color=c, capsize=4)
            vel = velocity.get(d, {}).get(leaf)
            if vel is not None and len(vel.segments) > 1:
                segs = vel.segments[1:]
                width = 0.8 / n
                xpos = np.arange(len(segs)) + (j - (n - 1) / 2) * width
                axv.bar(xpos, [sg.velocity for sg in segs], width=width, color=c,
                        yerr=[sg.velocity_se if sg.velocity_se is not None and
                              math.isfinite(sg.velocity_se) else 0 for sg in segs],
                        capsize=2, label=d)
                axv.set_xticks(np.arange(len(segs)),
                               [f"{sg.start}" for sg in segs], fontsize=7, rotation=45)
                axv.set_title(f"Δ{leaf} per {vel.k} steps (segment start step)", fontsize=9)
        axv.axhline(0, color="0.3", lw=0.8)
        axf.set_ylabel(leaf)
        axf.grid(alpha=0.3)
        axv.grid(alpha=0.3)
        _legend(axf, fontsize=7)
    axes[-1][0].set_xlabel("step (square: projection at the final step)")
    fig.suptitle(f"{run.name}: improvement velocity and projection")
    return fig


def _mixture_pdf(x: np.ndarray, weights, means, stds) -> np.ndarray:
    out = np.zeros_like(x)
    for w, m, s in zip(weights, means, stds):
        out += w * np.exp(-0.5 * ((x - m) / s) ** 2) / (s * math.sqrt(2 * math.pi))
    return out


def plot_loss_hist(run: Run, dists: dict[str, LossDistribution],
                   seq_len: tuple[np.ndarray, np.ndarray] | None = None) -> Figure:
    """Per drafter: histogram of the detrended per-batch loss with the 1/2-Gaussian fits and
    thresholds; and the residual against the batch's mean sequence length."""
    rows = max(len(dists), 1)
    fig = Figure(figsize=(12, 3.6 * rows), layout="constrained")
    axes = fig.subplots(rows, 2, squeeze=False)
    for (ax, axs), (d, dist) in zip(axes, dists.items()):
        if dist.bimodality is None:
            ax.text(0.5, 0.5, dist.note, ha="center", transform=ax.transAxes)
            axs.set_axis_off()
            continue
        edges = np.asarray(dist.hist_edges)
        widths = np.diff(edges)
        dens = np.asarray(dist.hist_counts) / max(dist.n, 1) / widths
        ax.bar(edges[:-1], dens, width=widths, align="edge", color="0.75", label="batches")
        xs = np.linspace(edges[0], edges[-1], 400)
        one, two = dist.bimodality.one, dist.bimodality.two
        ax.plot(xs, _mixture_pdf(xs, one.weights, one.means, one.stds), "C0", label="1 Gaussian")
        ax.plot(xs, _mixture_pdf(xs, two.weights, two.means, two.stds), "C3",
                label=f"2 Gaussians (ΔBIC {dist.bimodality.delta_bic:.0f})")
        for t in dist.thresholds:
            ax.axvline(t, color="k", ls=":", lw=1)
        ax.set_title(f"{d}: detrended per-batch loss, {dist.bimodality.verdict}", fontsize=9)
        _legend(ax, fontsize=7)
        if seq_len is not None and len(seq_len[0]):
            lookup = dict(zip(seq_len[0].tolist(), seq_len[1].tolist()))
            resid = detrend(dist.raw, dist.window)
            sl = np.array([lookup.get(int(s), np.nan) for s in dist.steps])
            axs.scatter(sl, resid, s=6, alpha=0.5)
            corr = next((c for c in dist.correlations if c.against == "train/seq_len"), None)
            if corr is not None and corr.pearson is not None:
                axs.set_title(f"residual vs seq_len: Pearson {corr.pearson:+.2f}, "
                              f"Spearman {corr.spearman:+.2f}", fontsize=9)
            axs.set_xlabel("mean real tokens per row (train/seq_len)")
            axs.set_ylabel("loss − rolling median")
        else:
            axs.text(0.5, 0.5, "train/seq_len not logged", ha="center", transform=axs.transAxes)
            axs.set_axis_off()
    fig.suptitle(f"{run.name}: per-batch loss distribution")
    return fig


def plot_grad_norm(run: Run, stats: dict[str, GradStats]) -> Figure:
    """Gradient norm per drafter over steps (log scale, clip line, clipped steps marked)."""
    rows = max(len(run.drafters), 1)
    fig = Figure(figsize=(12, 3.2 * rows), layout="constrained")
    axes = fig.subplots(rows, 2, squeeze=False, width_ratios=[3, 1])
    for (ax, axh), d in zip(axes, run.drafters):
        s, v = run.series(f"train/{d}/grad_norm")
        if not len(s):
            ax.text(0.5, 0.5, "grad_norm not logged", ha="center", transform=ax.transAxes)
            continue
        ax.plot(s, v, lw=0.8, alpha=0.7, label="grad norm (pre-clip)")
        ax.plot(s, smooth(v, default_window(len(v))), lw=1.5, label="smoothed")
        st = stats.get(d)
        if st is not None and st.clip is not None:
            ax.axhline(st.clip, color="tab:red", ls="--", lw=1, label=f"clip {st.clip:g}")
        cs, cv = run.series(f"train/{d}/clipped")
        if len(cs):
            hit = cv > 0.5
            lookup = dict(zip(s.tolist(), v.tolist()))
            ax.plot(cs[hit], [lookup.get(int(x), np.nan) for x in cs[hit]], "x",
                    color="tab:red", ms=3, label="clipped")
        if np.all(v > 0):
            ax.set_yscale("log")
        _events(ax, run, None)
        ax.set_title(f"{d}: clipped share "
                     f"{'n/a' if st is None or st.clipped_share is None else f'{st.clipped_share:.1%}'}",
                     fontsize=9)
        _legend(ax, fontsize=7)
        ax.grid(alpha=0.3)
        pos = v[v > 0]
        if len(pos):
            axh.hist(np.log10(pos), bins=30, color="0.6")
            axh.set_xlabel("log10 grad norm")
    fig.suptitle(f"{run.name}: gradient norm")
    return fig


def plot_schedules(run: Run) -> Figure:
    """lr, noise σ and anchors per drafter over steps."""
    fig = Figure(figsize=(11, 7), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    for ax, leaf in zip(axes, ("lr", "noise", "anchors")):
        any_ = False
        for d, c in zip(run.drafters, _colors(len(run.drafters))):
            s, v = run.series(f"train/{d}/{leaf}")
            if len(s):
                ax.plot(s, v, color=c, lw=1.2, label=d)
                any_ = True
        if not any_:
            ax.text(0.5, 0.5, f"{leaf} not logged", ha="center", transform=ax.transAxes)
        _events(ax, run, None)
        ax.set_ylabel(leaf)
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=7)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"{run.name}: schedules")
    return fig


def plot_compare(runs: list[Run], names: list[str], by: str = "step") -> Figure:
    """Smoothed train loss/acc/streak (and val points) of every run × drafter, aligned by
    ``by`` = "step" or "tokens" (tokens seen; runs without it fall back to step)."""
    fig = Figure(figsize=(11, 8.5), layout="constrained")
    axes = fig.subplots(len(LEAVES), 1, sharex=True)
    lines = [(r, n, d) for r, n in zip(runs, names) for d in r.drafters]
    for ax, leaf in zip(axes, LEAVES):
        for (r, n, d), c in zip(lines, _colors(len(lines))):
            x, v = aligned(r, f"train/{d}/{leaf}", by)
            fallback = by == "tokens" and not len(r.series(TOKENS)[0])
            if len(x):  # a run without tokens seen is drawn by step, dotted, and says so
                ax.plot(x, smooth(v, default_window(len(v))), color=c, lw=1.5,
                        ls=":" if fallback else "-",
                        label=f"{n} [{d}]" + (" (x = step: no tokens_seen)" if fallback else ""))
            xv, vv = aligned(r, f"val/{d}/{leaf}", by)
            if len(xv):
                ax.plot(xv, vv, "o--", color=c, ms=4, lw=0.8)
        ax.set_ylabel(leaf)
        ax.grid(alpha=0.3)
    _legend(axes[0], fontsize=7)
    axes[-1].set_xlabel("tokens seen (train/tokens_seen)" if by == "tokens" else "step")
    fig.suptitle(f"comparison by {'tokens seen' if by == 'tokens' else 'step'}")
    return fig
