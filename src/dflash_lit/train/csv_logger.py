"""Lightning's CSV logger, made to survive a relaunch in the same run directory.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when its writer starts. A job
relaunched in a fixed run directory (``hydra.run.dir=DIR ckpt_path=last``, the cluster-requeue
pattern) therefore lost every metric logged before the pre-emption. Here the writer keeps the
file: its rows stay, and when the new launch logs its first row at step ``s``, the earlier
launch's rows at steps >= ``s`` are dropped, because the resumed run logs those steps again
(from the checkpoint on, bit-exactly). The header grows as new metric keys appear, as in
Lightning.
"""

from __future__ import annotations

import csv
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class _KeepingWriter(ExperimentWriter):
    """``ExperimentWriter`` that continues an existing ``metrics.csv`` instead of deleting it."""

    def _check_log_dir_exists(self) -> None:  # Lightning deletes metrics.csv here
        self._resume_pending = self._fs.isfile(self.metrics_file_path)
        if self._resume_pending:
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = list(csv.DictReader(f).fieldnames or [])

    def log_metrics(self, metrics_dict: dict[str, Any], step: int | None = None) -> None:
        if self._resume_pending and step is not None:  # set in __init__
            self._drop_rows_from(int(step))
            self._resume_pending = False
        super().log_metrics(metrics_dict, step)

    def _drop_rows_from(self, step: int) -> None:
        """Rewrite the file without the earlier launch's rows at steps >= ``step``."""
        with self._fs.open(self.metrics_file_path, "r", newline="") as f:
            rows = [r for r in csv.DictReader(f) if not r.get("step") or int(r["step"]) < step]
        with self._fs.open(self.metrics_file_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(rows)


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``metrics.csv`` survives a relaunch in the same directory."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        """The writer, created on first use (as in ``CSVLogger``)."""
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeepingWriter(log_dir=self.log_dir)
        return self._experiment
