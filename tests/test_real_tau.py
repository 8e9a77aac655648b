"""The real-τ callback: during training it decodes held-out prompts with the current weights
(chain, DDTree, n-gram once), logs τ per drafter and the ratio to n-gram, checks losslessness,
online and from cached features (where it loads the target itself)."""

from __future__ import annotations

import csv

import pytest
from train_utils import base_overrides, make_shards, run_train

CB = ["+callbacks.real_tau._target_=dflash_lit.train.real_tau.RealAcceptance",
      "+callbacks.real_tau.every_n_steps=2", "+callbacks.real_tau.num_prompts=2",
      "+callbacks.real_tau.max_new_tokens=12", "+callbacks.real_tau.tree_budget=4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tau")
    return make_shards(root / "train", n=16), make_shards(root / "val", n=4, seed=1)


@pytest.mark.parametrize("features", ["online", "cache"])
def test_real_tau_is_logged_per_drafter(tmp_path, data, features):
    train, val = data
    ov = base_overrides(tmp_path, train, val) + [
        "experiment=multi_drafter", "trainer.max_steps=3", f"features={features}", *CB]
    run_train(ov, tmp_path / "run")
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = {int(r["step"]): r for r in rows if r.get("val/gamma7/tau_chain")}
    assert sorted(logged) == [2, 3]  # every 2 steps and at the last step
    for r in logged.values():
        ngram, suffix = float(r["val/tau_ngram"]), float(r["val/tau_suffix"])
        assert 1.0 <= ngram <= 8.0 and 1.0 <= suffix <= 8.0
        assert float(r["val/tau_model_free"]) == max(ngram, suffix)
        for name in ("gamma4", "gamma7", "gamma10"):
            chain = float(r[f"val/{name}/tau_chain"])
            assert 1.0 <= chain <= 8.0 and 1.0 <= float(r[f"val/{name}/tau_tree_b4"]) <= 8.0
            assert float(r[f"val/{name}/tau_chain_vs_ngram"]) == pytest.approx(chain / ngram)
            assert float(r[f"val/{name}/tau_chain_vs_model_free"]) == pytest.approx(
                chain / max(ngram, suffix))
            assert float(r[f"val/{name}/lossless"]) == 1.0
        assert 0.0 < float(r["perf/real_tau_share"]) < 1.0


def test_bad_settings_are_refused():
    from dflash_lit.train.real_tau import RealAcceptance

    with pytest.raises(ValueError, match="callbacks.real_tau"):
        RealAcceptance(every_n_steps=0)
