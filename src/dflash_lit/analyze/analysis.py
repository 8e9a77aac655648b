"""``analyze_run``: every analysis of one run, as plain data (report.py renders it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_lit.analyze.distribution import LossDistribution, loss_distribution
from dflash_lit.analyze.events import (
    SCHEDULE_LEAVES,
    EventCheck,
    check_epochs,
    check_resume,
    epoch_boundaries,
)
from dflash_lit.analyze.fits import Projection, project
from dflash_lit.analyze.grads import GradStats, grad_stats
from dflash_lit.analyze.logs import Run, cfg_get, grad_clip_of
from dflash_lit.analyze.stats import finite_or_none
from dflash_lit.analyze.velocity import Velocity, segment_velocity

LEAVES = ("loss", "acc", "streak")


@dataclass
class Options:
    segment: int | None = None  # k steps per velocity segment (None: ~n_segments segments)
    n_segments: int = 8
    final_step: int | None = None  # projection step (wins over trainer.max_steps when given)
    skip_frac: float = 0.1  # warm-up share of steps left out of the loss distribution
    thresholds: tuple[float, float] | None = None  # loss thresholds (default median ± 2σ)
    window: int | None = None  # points each side of an epoch boundary / resume
    z_threshold: float = 3.0
    n_boot: int = 200
    seed: int = 0


@dataclass
class RunAnalysis:
    run: str
    path: str
    dirs: list[str]
    source: str
    drafters: list[str]
    first_step: int
    last_step: int
    n_steps: int
    final_step: int
    final_step_source: str
    skipped_lines: list[str]
    notes: list[str]
    velocity: dict[str, dict[str, Velocity]] = field(default_factory=dict)
    projection: dict[str, dict[str, Projection]] = field(default_factory=dict)
    distribution: dict[str, LossDistribution] = field(default_factory=dict)
    grads: dict[str, GradStats] = field(default_factory=dict)
    epochs: list[EventCheck] = field(default_factory=list)
    resumes: list[EventCheck] = field(default_factory=list)
    verdicts: dict[str, str] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        """Everything as JSON-able data (NaN → null; per-step arrays left out)."""
        return to_jsonable(self)


def to_jsonable(obj):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not isinstance(getattr(obj, f.name), np.ndarray)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.ndarray):
        return [to_jsonable(v) for v in obj.tolist()]
    return finite_or_none(obj)


def resolve_final_step(run: Run, override: int | None = None) -> tuple[int, str]:
    """Where training will end: --final-step, else the run's recorded ``total_steps``, else
    trainer.max_steps (> 0), else
    trainer.max_epochs × steps per epoch (from the first logged epoch boundary), else
    the last step × 2."""
    if override:
        return int(override), "--final-step"
    ts = cfg_get(run.config, "total_steps")  # what train.py sized the schedules with
    if isinstance(ts, int) and ts > 0:
        return ts, "total_steps (train.py's schedule length)"
    ms = cfg_get(run.config, "trainer.max_steps")
    try:
        if ms is not None and int(ms) > 0:
            return int(ms), "trainer.max_steps"
    except (TypeError, ValueError):
        pass
    me = cfg_get(run.config, "trainer.max_epochs")
    bounds = epoch_boundaries(run.df)
    try:
        me = int(me) if me is not None else 0
    except (TypeError, ValueError):
        me = 0
    if me > 0 and bounds:
        step, old, new = bounds[0]
        per_epoch = step / max(new, 1)
        return int(round(me * per_epoch)), (f"trainer.max_epochs={me} × ~{per_epoch:.0f} "
                                            "steps/epoch (from the first epoch boundary)")
    return max(2 * run.last_step, 1), "last step × 2 (no max_steps in the config)"


def _verdict(vel: dict[str, Velocity], run: Run, d: str) -> str:
    s, v = run.series(f"train/{d}/loss")
    raw = run.df[f"train/{d}/loss"].to_numpy(dtype=float) if f"train/{d}/loss" in run.df else []
    bad = int(np.sum(np.isinf(raw)))
    if bad:
        return f"broken: {bad} step(s) with infinite loss"
    if len(v) and not np.isfinite(v[-1]):
        return "broken: the last loss is not finite"
    primary = vel.get("acc") or vel.get("loss")
    if primary is None or primary.trend == "too few points":
        return "too few points to judge"
    trends = {leaf: vel[leaf].trend for leaf in LEAVES if leaf in vel}
    if "getting worse" in (trends.get("acc"), trends.get("loss")):
        return "getting worse (" + ", ".join(f"{k}: {t}" for k, t in trends.items()) + ")"
    if "still improving" in (trends.get("acc"), trends.get("loss")):
        word = "still learning"
    elif "slowing" in (trends.get("acc"), trends.get("loss")):
        word = "slowing down"
    else:
        word = "plateaued"
    return f"{word} (" + ", ".join(f"{k}: {t}" for k, t in trends.items()) + ")"


def plateau_flags(run: Run) -> list[str]:
    """Copy-the-anchor plateau at the last validation, and real chain τ below n-gram."""
    from dflash_lit.train.plateau import plateau_message

    flags = []
    for d in run.drafters:
        cs, cv = run.series(f"val/{d}/const_block_share")
        _, av = run.series(f"val/{d}/anchor_sensitivity")
        _, sv = run.series(f"val/{d}/slot_spread")
        if len(cv) and len(av):
            msg = plateau_message(d, float(cv[-1]), float(av[-1]),
                                  float(sv[-1]) if len(sv) else None)
            if msg:
                flags.append(f"validation at step {int(cs[-1])}: {msg}")
        ts, tv = run.series(f"val/{d}/tau_chain_vs_model_free")
        if not len(tv):  # logs written before the suffix baseline
            ts, tv = run.series(f"val/{d}/tau_chain_vs_ngram")
        if len(tv) and tv[-1] < 1.0:
            flags.append(f"{d}: real chain τ is {tv[-1]:.2f}x the model-free baseline at step "
                         f"{int(ts[-1])}: the drafter does not yet beat no training")
    return flags


def analyze_run(run: Run, opts: Options | None = None) -> RunAnalysis:
    """Velocity, projections, loss distribution, grad norms, epoch and resume checks."""
    opts = opts or Options()
    final, final_src = resolve_final_step(run, opts.final_step)
    steps = run.df["step"] if len(run.df) else []
    out = RunAnalysis(
        run=run.name, path=str(run.path), dirs=[str(d) for d in run.dirs], source=run.source,
        drafters=run.drafters, first_step=int(min(steps)) if len(steps) else 0,
        last_step=run.last_step, n_steps=len(run.df), final_step=final,
        final_step_source=final_src, skipped_lines=list(run.skipped), notes=list(run.notes))
    if not run.drafters:
        out.notes.append("no train/<drafter>/loss column: no per-drafter analysis possible")
    covs = {}
    for c in ["train/seq_len"] + sorted(c for c in run.df.columns
                                         if c.startswith("train/source/")):
        if c in run.df.columns:
            covs[c] = run.series(c)
    if not any(c.startswith("train/source/") for c in covs):
        out.notes.append("data source per batch: not logged (no train/source/* column)")
    for d in run.drafters:
        out.velocity[d], out.projection[d] = {}, {}
        for leaf in LEAVES:
            s, v = run.series(f"train/{d}/{leaf}")
            if not len(s):
                continue
            metric = f"train/{d}/{leaf}"
            out.velocity[d][leaf] = segment_velocity(s, v, metric, opts.segment, opts.n_segments)
            out.projection[d][leaf] = project(s, v, final, metric, final_src, opts.n_boot,
                                              opts.seed)
        s, v = run.series(f"train/{d}/loss")
        out.distribution[d] = loss_distribution(
            s, v, f"train/{d}/loss", covs, opts.skip_frac, opts.thresholds)
        gs, gv = run.series(f"train/{d}/grad_norm")
        cs, cv = run.series(f"train/{d}/clipped")
        out.grads[d] = grad_stats(d, gs, gv, cv if len(cs) else None,
                                  grad_clip_of(run.config, d))
        out.verdicts[d] = _verdict(out.velocity[d], run, d)
    metrics = [f"train/{d}/{leaf}" for d in run.drafters for leaf in LEAVES]
    out.epochs = check_epochs(run.df, metrics, opts.window, opts.z_threshold)
    schedules = [f"train/{d}/{leaf}" for d in run.drafters for leaf in SCHEDULE_LEAVES]
    schedules.append("train/tokens_seen")
    for ev in run.resumes:
        out.resumes.append(check_resume(run.df, ev, metrics, schedules, opts.window,
                                        opts.z_threshold))
    for ev in out.resumes:
        out.flags += [f"resume at step {ev.step}: {m}" for m in ev.messages]
    for ev in out.epochs:
        out.flags += [f"{ev.label} at step {ev.step}: {m}" for m in ev.messages]
    nf = run.series("train/nonfinite_skipped")[1]
    if len(nf) and nf.max() > 0:
        out.flags.append(f"{int(nf.max())} step(s) skipped for non-finite loss/hidden states")
    for d, g in out.grads.items():
        if g.clipped_share is not None and g.clipped_share > 0.5:
            out.flags.append(f"{d}: {g.clipped_share:.0%} of steps clipped (clip {g.clip}): "
                             "the clip norm binds most of the time")
    out.flags += plateau_flags(run)
    if run.skipped:
        out.flags.append(f"{len(run.skipped)} malformed log line(s) skipped (see the report)")
    for d, dist in out.distribution.items():
        if dist.bimodality is not None and dist.bimodality.verdict == "bimodal":
            two = dist.bimodality.two
            out.flags.append(f"{d}: per-batch loss is bimodal (modes {two.means[0]:.3g} / "
                             f"{two.means[1]:.3g}, weights {two.weights[0]:.0%} / "
                             f"{two.weights[1]:.0%}): two kinds of batches?")
    return out
