"""Write the analysis: ``report.md`` (tables + embedded plots), PNGs and ``summary.json``."""

from __future__ import annotations

import json
import math
from pathlib import Path

from dflash_lit.analyze import plots
from dflash_lit.analyze.analysis import LEAVES, RunAnalysis, to_jsonable
from dflash_lit.analyze.compare import Comparison
from dflash_lit.analyze.logs import Run
from dflash_lit.analyze.stats import default_window, smooth

MAX_LIST = 30  # skipped lines / metric names listed in full before "... and N more"


def fmt(v, digits: int = 4) -> str:
    """Compact number for tables; '—' for missing."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.{digits}g}"
    return str(v)


def table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in r) + " |"
            for r in rows]
    return "\n".join(out) + "\n"


def _listing(items: list[str]) -> str:
    if not items:
        return "none\n"
    shown = [f"- {x}" for x in items[:MAX_LIST]]
    if len(items) > MAX_LIST:
        shown.append(f"- ... and {len(items) - MAX_LIST} more")
    return "\n".join(shown) + "\n"


def save_figures(run: Run, a: RunAnalysis, out: Path) -> list[str]:
    """Render and save the run's PNGs; returns their file names."""
    epochs = [e.step for e in a.epochs]
    seq = run.series("train/seq_len")
    figs = {
        "metrics.png": plots.plot_metrics(run, epochs),
        "velocity.png": plots.plot_velocity(run, a.velocity, a.projection),
        "loss_hist.png": plots.plot_loss_hist(run, a.distribution, seq if len(seq[0]) else None),
        "grad_norm.png": plots.plot_grad_norm(run, a.grads),
        "schedules.png": plots.plot_schedules(run),
    }
    for name, fig in figs.items():
        fig.savefig(out / name, dpi=110)
    return list(figs)


def _velocity_section(a: RunAnalysis) -> str:
    parts = []
    for d, vel in a.velocity.items():
        if not vel:
            continue
        base = vel.get("loss") or next(iter(vel.values()))
        parts.append(f"**{d}** — segments of {base.k} steps; Δ = change of the segment mean "
                     f"vs the previous segment, per {base.k} steps (± standard error); ratio = "
                     "Δ / previous Δ.\n")
        header = ["segment", "steps", "n"]
        for leaf in LEAVES:
            if leaf in vel:
                header += [f"mean {leaf}", f"Δ{leaf}", "ratio"]
        rows = []
        for i, seg in enumerate(base.segments):
            row = [str(i), f"{seg.start}–{seg.end - 1}", seg.n]
            for leaf in LEAVES:
                if leaf not in vel:
                    continue
                segs = vel[leaf].segments
                sg = segs[i] if i < len(segs) and segs[i].start == seg.start else None
                if sg is None:
                    row += ["—", "—", "—"]
                    continue
                dv = "—" if sg.velocity is None else (
                    f"{fmt(sg.velocity)} ± {fmt(sg.velocity_se, 2)}")
                row += [fmt(sg.mean), dv, fmt(sg.ratio, 3)]
            rows.append(row)
        parts.append(table(header, rows))
        parts.append(table(["metric", "trend (last segment)", "velocity decay"],
                           [[leaf, v.trend, v.decay_note or "—"] for leaf, v in vel.items()]))
    return "\n".join(parts) if parts else "No per-drafter train metrics.\n"


def _projection_section(run: Run, a: RunAnalysis) -> str:
    rows = []
    for d, projs in a.projection.items():
        for leaf, p in projs.items():
            s, v = run.series(f"train/{d}/{leaf}")
            last = float(smooth(v, default_window(len(v)))[-1]) if len(v) else None
            if p.chosen is None:
                rows.append([d, leaf, last, "—", "—", "—", "—", "—", p.note])
                continue
            params = ", ".join(f"{k}={fmt(x)}" for k, x in p.chosen.params.items())
            hold = " / ".join(f"{f.name} {fmt(f.holdout_rmse, 3)}" for f in p.fits)
            aic = " / ".join(f"{f.name} {f.aic:.1f}" for f in p.fits)
            rows.append([d, leaf, last, p.value, f"{fmt(p.lo)} – {fmt(p.hi)}",
                         f"{p.chosen.name} ({params})", hold, aic, p.note or "—"])
    if not rows:
        return "Nothing to project.\n"
    sel = next((p.selected_by for ps in a.projection.values() for p in ps.values()
                if p.selected_by), "")
    head = (f"Projection at step {a.final_step} ({a.final_step_source}). Models: linear "
            "a+b·x, log a+b·ln x, power a−b·x^(−c), exp a−b·e^(−x/τ) (x = step+1); chosen by "
            f"{sel or 'held-out RMSE'}; 10–90 % from a residual bootstrap.\n\n")
    return head + table(["drafter", "metric", "last (smoothed)", "projected", "10–90 %",
                         "chosen fit", "held-out RMSE", "AIC", "note"], rows)


def _distribution_section(a: RunAnalysis) -> str:
    rows, crows = [], []
    for d, dist in a.distribution.items():
        if dist.bimodality is None:
            rows.append([d, dist.n, dist.skipped_warmup] + ["—"] * 9 + [dist.note])
            continue
        q, b = dist.quantiles, dist.bimodality
        two = b.two
        rows.append([
            d, dist.n, dist.skipped_warmup, q["p5"], q["p50"], q["p95"],
            f"{fmt(dist.thresholds[0])} / {fmt(dist.thresholds[1])} ({dist.threshold_rule})",
            f"{dist.share_below:.1%} / {dist.share_above:.1%}",
            f"{fmt(two.means[0])} / {fmt(two.means[1])}",
            f"{two.weights[0]:.2f} / {two.weights[1]:.2f}",
            f"{fmt(two.stds[0], 3)} / {fmt(two.stds[1], 3)}",
            f"{b.delta_bic:.1f} (D={b.separation:.2f})", b.verdict])
        for c in dist.correlations:
            crows.append([d, c.against, c.n, c.pearson, c.spearman, c.p_pearson, c.note or "—"])
    txt = ("Per-batch `train/<d>/loss` after the first warm-up share of steps, detrended "
           "against a centred rolling median and shifted back to its median level (so the "
           "numbers describe batch-to-batch scatter, not the learning curve).\n\n")
    txt += table(["drafter", "batches", "warm-up skipped", "p5", "p50", "p95",
                  "thresholds lo / hi", "share below / above", "2-Gaussian means",
                  "weights", "stds", "ΔBIC = BIC1−BIC2", "verdict"], rows)
    txt += "\nCorrelation of the detrended per-batch loss with per-batch covariates:\n\n"
    txt += table(["drafter", "against", "n", "Pearson", "Spearman", "p (Pearson)", "note"],
                 crows) if crows else "no covariate logged (train/seq_len, train/source/*)\n"
    return txt


def _grad_section(a: RunAnalysis) -> str:
    rows = [[d, g.n, g.mean, g.p50, g.p90, g.p99,
             f"{fmt(g.max)} (step {g.max_step})" if g.max is not None else "—",
             g.clip, "—" if g.clipped_share is None else f"{g.clipped_share:.1%}",
             g.clipped_source or "—", g.spikes] for d, g in a.grads.items()]
    return table(["drafter", "steps", "mean", "p50", "p90", "p99", "max", "clip",
                  "clipped", "from", "spikes (>5× rolling median)"], rows)


def _jump_rows(events) -> list[list]:
    rows = []
    for ev in events:
        for j in ev.jumps:
            rows.append([str(ev.step), ev.label, j.metric, j.n_before, j.n_after,
                         j.before_mean, j.after_mean, j.predicted, j.excess, j.sigma, j.z,
                         "**FLAG**" if j.flagged else (j.note or "ok")])
    return rows


_JUMP_HEAD = ["step", "event", "metric", "n before", "n after", "mean before", "mean after",
              "trend-predicted", "excess", "σ (pre residual)", "z", "flag"]


def _events_section(a: RunAnalysis) -> str:
    txt = "### Epoch boundaries\n\n"
    if a.epochs:
        txt += table(_JUMP_HEAD, _jump_rows(a.epochs))
    else:
        txt += "No epoch boundary in the logged steps.\n"
    txt += "\n### Resume events\n\n"
    if not a.resumes:
        txt += "The run was not resumed (no resumed_from.txt in the chain).\n"
        return txt
    txt += table(_JUMP_HEAD, _jump_rows(a.resumes))
    crow = [[str(ev.step), c.metric, c.before, c.after, c.predicted,
             "**RESTARTED**" if c.flagged else "ok"] for ev in a.resumes for c in ev.continuity]
    if crow:
        txt += "\nSchedules and counters across each resume (first value after vs the linear "
        txt += "extrapolation of the values before):\n\n"
        txt += table(["step", "schedule", "last before", "first after", "expected", "check"],
                     crow)
    return txt


def render_markdown(run: Run, a: RunAnalysis, images: list[str]) -> str:
    chain = " → ".join(f"`{d}`" for d in a.dirs) if a.dirs else f"`{a.path}`"
    res = "; ".join(f"resumed at step {e.step} from `{e.from_dir}`"
                    + ("" if e.found else " (missing)") for e in run.resumes) or "not resumed"
    md = [f"# Training-log analysis: {a.run}\n",
          f"- Logs: {chain} (source: {a.source}); {res}",
          f"- Steps logged: {a.first_step}–{a.last_step} ({a.n_steps} steps with a row); "
          f"drafters: {', '.join(a.drafters) or 'none'}",
          f"- Projections at step {a.final_step} ({a.final_step_source})\n",
          "## Verdict\n",
          table(["drafter", "verdict (heuristic on the last segment's velocity)"],
                [[d, v] for d, v in a.verdicts.items()]),
          "**Flags**\n", _listing(a.flags),
          "**Notes**\n", _listing(a.notes),
          f"**Skipped log lines** ({len(a.skipped_lines)})\n", _listing(a.skipped_lines)]
    img = {n: f"![{n[:-4]}]({n})\n" for n in images}
    md += ["## Curves\n", img.get("metrics.png", ""),
           "## Improvement velocity\n", _velocity_section(a), img.get("velocity.png", ""),
           "## Projection\n", _projection_section(run, a),
           "## Loss distribution over batches\n", _distribution_section(a),
           img.get("loss_hist.png", ""),
           "## Gradient norm\n", _grad_section(a), img.get("grad_norm.png", ""),
           "## Schedules\n", img.get("schedules.png", "") or "—\n",
           "## Events\n", _events_section(a)]
    return "\n".join(md)


def write_run_report(run: Run, a: RunAnalysis, out: str | Path, figures: bool = True) -> Path:
    """Write report.md, summary.json and the PNGs into ``out``; returns the report path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    images = save_figures(run, a, out) if figures else []
    (out / "summary.json").write_text(json.dumps(a.summary(), indent=1, allow_nan=False))
    path = out / "report.md"
    path.write_text(render_markdown(run, a, images))
    return path


def write_compare_report(runs: list[Run], comp: Comparison, out: str | Path,
                         figures: bool = True) -> Path:
    """compare_step.png, compare_tokens.png, report.md and summary.json for several runs."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    images = []
    if figures:
        for by in ("step", "tokens"):
            plots.plot_compare(runs, comp.runs, by).savefig(out / f"compare_{by}.png", dpi=110)
            images.append(f"compare_{by}.png")
    rows = [[n, f"`{r.path}`", r.source, f"{int(r.df['step'].min()) if len(r.df) else 0}–"
             f"{r.last_step}", ", ".join(r.drafters) or "—",
             "tokens seen" if comp.x_tokens[n] else "step (no train/tokens_seen)"]
            for n, r in zip(comp.runs, runs)]
    md = ["# Run comparison\n",
          table(["run", "dir", "source", "steps", "drafters", "x for the tokens plot"], rows),
          f"\n## Shared metrics ({len(comp.shared)})\n", _listing(comp.shared),
          "\n## Metrics each run lacks (that another run has)\n"]
    for n, miss in comp.missing.items():
        md += [f"**{n}** ({len(miss)})\n", _listing(miss)]
    md += ["\n## Final values (train: smoothed; val: last)\n",
           table(["run", "drafter", "last step", "tokens seen"]
                 + [f"{p} {leaf}" for leaf in LEAVES for p in ("train", "val")],
                 [[f["run"], f["drafter"], f["last_step"], f["tokens_seen"]]
                  + [f[f"{p}_{leaf}"] for leaf in LEAVES for p in ("train", "val")]
                  for f in comp.finals]),
           "\n## Curves\n"] + [f"![{i[:-4]}]({i})\n" for i in images]
    (out / "summary.json").write_text(json.dumps(to_jsonable(comp), indent=1, allow_nan=False))
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path
