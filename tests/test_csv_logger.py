"""The CSV logger keeps a run's metrics.csv across relaunches in the same directory: the
earlier launch's rows stay, its rows past the resumed step are replaced by the new launch's."""

from __future__ import annotations

import csv

from dflash_lit.train.csv_logger import ResumableCSVLogger


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_relaunch_keeps_earlier_rows_and_replaces_the_replayed_tail(tmp_path):
    first = ResumableCSVLogger(tmp_path, name="csv", version="", flush_logs_every_n_steps=1)
    for step in range(10):  # killed at step 9; its last checkpoint was at step 6
        first.log_metrics({"loss": float(step)}, step=step)
        first.save()
    second = ResumableCSVLogger(tmp_path, name="csv", version="", flush_logs_every_n_steps=1)
    for step in range(6, 12):  # the relaunch replays 6.. and logs a new key
        second.log_metrics({"loss": 100.0 + step, "acc": 0.5}, step=step)
        second.save()
    rows = _rows(tmp_path / "csv" / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(12))
    assert [float(r["loss"]) for r in rows] == [*range(6), *(100.0 + s for s in range(6, 12))]
    assert [r["acc"] for r in rows[:6]] == [""] * 6 and rows[6]["acc"] == "0.5"


def test_fresh_directory_behaves_like_lightning(tmp_path):
    log = ResumableCSVLogger(tmp_path, name="csv", version="")
    log.log_metrics({"loss": 1.0}, step=0)
    log.save()
    assert [(r["step"], r["loss"]) for r in _rows(tmp_path / "csv" / "metrics.csv")] == [("0", "1.0")]
