"""bench/quality.py's aggregation over seeds: mean ± sample standard deviation per recipe and
chain τ relative to v5's mean, on hand-computed numbers."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from train_utils import REPO


@pytest.fixture(scope="module")
def quality():
    sys.path.insert(0, str(REPO / "bench"))  # its `common` helper module
    spec = importlib.util.spec_from_file_location("quality", REPO / "bench" / "quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    sys.path.remove(str(REPO / "bench"))


def _row(recipe, seed, streak, chain, tree, ngram):
    r = {"recipe": recipe, "seed": seed, "val_streak": streak}
    for t in ("he", "ho"):
        r.update({f"{t}_chain": chain, f"{t}_tree16": tree, f"{t}_ngram": ngram,
                  f"{t}_lossless": True})
    return r


def test_mean_sd_over_seeds_and_ratio_to_v5(quality):
    rows = [_row("v5_hardce", 0, 10.0, 4.0, 5.0, 2.0), _row("v5_hardce", 1, 12.0, 6.0, 7.0, 2.0),
            _row("v3_composite", 0, 8.0, 2.5, 3.0, 2.0), _row("v3_composite", 1, 8.0, 3.5, 4.0, 2.0)]
    agg = {a["recipe"]: a for a in quality.aggregate(rows)}
    v5, v3 = agg["v5_hardce"], agg["v3_composite"]
    assert v5["seeds"] == 2 and v5["val_streak"] == "11.00 ± 1.41"  # stdev of (10, 12)
    assert v5["he_chain"] == "5.00 ± 1.41" and v5["ho_ngram"] == "2.00 ± 0.00"
    assert v5["he_chain_vs_v5"] == "1.00 ± 0.28"  # 4/5, 6/5
    assert v3["he_chain_vs_v5"] == "0.60 ± 0.14"  # 2.5/5, 3.5/5
    assert v3["lossless"] is True
    rows[0]["ho_lossless"] = False
    assert quality.aggregate(rows)[0]["lossless"] is False


def test_exit_steps_listed_per_seed(quality):
    rows = [_row("v5_hardce", 0, 10.0, 4.0, 5.0, 2.0), _row("v5_hardce", 1, 2.0, 1.0, 2.0, 2.0),
            _row("v5_hardce", 2, 9.0, 4.0, 5.0, 2.0)]
    rows[0]["exit_step"], rows[1]["exit_step"] = 150, None  # seed 2: recorded before them
    assert quality.aggregate(rows)[0]["exit_steps"] == "150/never/?"


def test_plateau_exit_step_from_the_csv(quality, tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "EXIT_WINDOW", 3)
    (tmp_path / "csv").mkdir()
    lines = ["step,train_window/main/streak,val/main/acc",
             "0,0.0,", "20,0.6,", "40,,0.3", "60,3.5,", "80,0.5,", "100,0.4,",  # 60: a spike
             "120,2.9,", "140,3.4,", "160,8.0,", "180,9.0,"]
    (tmp_path / "csv" / "metrics.csv").write_text("\n".join(lines) + "\n")
    # windows of 3 logged steps: (2.9, 3.4, 8.0) is the first to average >= 3
    assert quality.plateau_exit_step(tmp_path, "main") == 120
    assert quality.plateau_exit_step(tmp_path, "other") is None  # never logged: never left
    assert quality.exit_step_entry(tmp_path, "main") == {"exit_step": 120}
    # a log that starts late (its beginning overwritten by a resume) cannot tell: "?"
    (tmp_path / "csv" / "metrics.csv").write_text("\n".join(lines[:1] + lines[5:]) + "\n")
    with pytest.raises(LookupError, match="starts at step 80"):
        quality.plateau_exit_step(tmp_path, "main")
    assert quality.exit_step_entry(tmp_path, "main") == {}
    assert quality.aggregate([{**_row("v5_hardce", 0, 9.0, 3.0, 4.0, 2.0)}])[0]["exit_steps"] == "?"


def test_recorded_rows_carry_their_settings(quality, tmp_path, monkeypatch):
    record = tmp_path / "quality.json"
    monkeypatch.setattr(quality, "RECORD", record)
    assert quality.recorded_rows() == []  # nothing recorded yet
    rows = [{**_row("v5_hardce", 0, 10.0, 4.0, 5.0, 2.0)},  # file-level settings
            {**_row("v5_hardce", 1, 10.0, 4.0, 5.0, 2.0), "limit": 10, "max_new_tokens": 64,
             "train_overrides": ["trainer.max_steps=40"]}]
    record.write_text(json.dumps({"rows": rows, "limit": 40, "max_new_tokens": 128}))
    got = quality.recorded_rows()
    assert [quality.settings(r) for r in got] == [(40, 128, ()),
                                                 (10, 64, ("trainer.max_steps=40",))]
    assert quality.base_recipe({"recipe": "multi_drafter/gamma4"}) == "multi_drafter"
    default, other = (quality.run_dir_for("v5_hardce", 1, o) for o in ([], ["seed=9"]))
    assert default.name == "v5_hardce_seed1" and other.name.startswith("v5_hardce_seed1_")


def test_precision_read_from_the_resolved_config(quality, tmp_path):
    assert quality.run_precision(tmp_path) is None  # no config: unknown, not guessed
    (tmp_path / "config_resolved.yaml").write_text("trainer:\n  precision: bf16-mixed\n")
    assert quality.run_precision(tmp_path) == "bf16-mixed"
    rows = [{**_row("v5_hardce", s, 10.0, 4.0, 5.0, 2.0), "precision": p}
            for s, p in ((0, "32-true"), (1, "bf16-mixed"), (2, "32-true"))]
    assert quality.aggregate(rows)[0]["precision"] == "32-true+bf16-mixed"


def test_exit_step_filled_only_from_the_same_finished_run(quality, tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "ROOT", tmp_path)
    run = tmp_path / "v5_hardce_seed1"
    (run / "csv").mkdir(parents=True)
    monkeypatch.setattr(quality, "EXIT_WINDOW", 1)
    (run / "csv" / "metrics.csv").write_text(
        "step,train_window/main/streak,val/main/streak\n0,0.5,\n40,3.5,\n60,,9.5\n")
    (run / "config_resolved.yaml").write_text("trainer:\n  precision: bf16-mixed\n")
    row = {**_row("v5_hardce", 1, 8.0, 3.0, 4.0, 2.0), "train_overrides": []}
    quality.fill_exit_step(row)
    assert "exit_step" not in row  # not finished: a rerun in progress
    (run / "done.json").write_text("{}")
    quality.fill_exit_step(row)
    assert "exit_step" not in row  # finished, but its val streak (9.5) is another run's
    row["val_streak"] = 9.5
    (run / "eval" / "humaneval_main").mkdir(parents=True)
    (run / "eval" / "humaneval_main" / "report.json").write_text(
        json.dumps({"methods": {"chain": {"slot_accept_rate": [0.8, 0.5]}}}))
    quality.fill_exit_step(row)
    assert row["exit_step"] == 40 and row["precision"] == "bf16-mixed"
    assert row["he_chain_slots"] == [0.8, 0.5] and "ho_chain_slots" not in row


def test_slot_table_means_per_slot_over_the_seeds_that_recorded_it(quality, monkeypatch):
    monkeypatch.setattr(quality, "SLOTS_SHOWN", (1, 2))
    rows = [{"recipe": "a", "he_chain_slots": [0.8, 0.4]},
            {"recipe": "a", "he_chain_slots": [0.6, 0.2]},
            {"recipe": "a"},  # recorded before per-slot acceptance was: left out
            {"recipe": "b", "he_chain_slots": [0.9, 0.7]}]
    assert quality.slot_table(rows) == [
        {"recipe": "a", "seeds": 2, "slot1": "0.70 ± 0.14", "slot2": "0.30 ± 0.14"},
        {"recipe": "b", "seeds": 1, "slot1": "0.90", "slot2": "0.70"}]
