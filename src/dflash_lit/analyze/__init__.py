"""Training-log analysis: ``python -m dflash_lit.analyze RUN_DIR [RUN_DIR ...]``.

Pure functions on DataFrames / arrays, shared by the CLI, the notebook and the tests::

    from dflash_lit.analyze import load_run, analyze_run, write_run_report
    run = load_run("outputs/v5_hardce/2026-12-02_15-37-58")
    a = analyze_run(run)            # velocity, projection, loss distribution, grads, events
    write_run_report(run, a, "analysis/")
"""

from dflash_lit.analyze.analysis import Options, RunAnalysis, analyze_run, resolve_final_step
from dflash_lit.analyze.compare import Comparison, compare_runs
from dflash_lit.analyze.distribution import (
    LossDistribution,
    bimodality,
    fit_gaussian,
    fit_mixture2,
    loss_distribution,
)
from dflash_lit.analyze.events import check_epochs, check_resume, epoch_boundaries, jump_at
from dflash_lit.analyze.fits import Projection, Reach, fit_model, project, steps_to_reach
from dflash_lit.analyze.grads import GradStats, grad_stats
from dflash_lit.analyze.logs import LogError, ResumeEvent, Run, load_run, read_metrics_csv
from dflash_lit.analyze.report import write_compare_report, write_run_report
from dflash_lit.analyze.velocity import Velocity, make_segments, segment_velocity

__all__ = [
    "Comparison", "GradStats", "LogError", "LossDistribution", "Options", "Projection",
    "Reach", "ResumeEvent", "Run", "RunAnalysis", "Velocity", "analyze_run", "bimodality",
    "check_epochs", "check_resume", "compare_runs", "epoch_boundaries", "fit_gaussian",
    "fit_mixture2", "fit_model", "grad_stats", "jump_at", "load_run", "loss_distribution",
    "make_segments", "project", "read_metrics_csv", "resolve_final_step", "segment_velocity",
    "steps_to_reach", "write_compare_report", "write_run_report",
]
