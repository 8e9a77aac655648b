"""The model card export.py writes: training facts from the run directory, the engine table
from an ``evaluate.py engine=vllm`` report, repository-relative paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_lit.errors import UserError
from dflash_lit.export.card import load_report, model_card, run_facts
from dflash_lit.paths import repo_root


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "csv").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text("- experiment=v6_muon\n- trainer.max_epochs=12\n"
                                                   "- hydra.run.dir=somewhere\n")
    root = repo_root()
    (run / "config_resolved.yaml").write_text(
        f"target:\n  path: {root}/artifacts/tiny/target\ndata:\n  path: {root}/artifacts/tiny/data/train\n")
    (run / "csv" / "metrics.csv").write_text(
        "step,perf/step_s,train/tokens_seen\n1,30.0,1000\n2,,\n3,90.0,3000\n")
    return run


def _report() -> dict:
    def m(tau, tps, speedup):
        return {"tau": tau, "tokens_per_s": tps, "speedup": speedup}

    return {
        "engine": {"name": "vllm", "version": "0.32.0", "dtype": "float32",
                   "tokens_per_s_measured_at": 1,
                   "concurrency": {"1": {}, "8": {"chain": m(9.0, 800.0, 1.6),
                                                  "baseline": m(1, 500.0, 1.0)}}},
        "methods": {"baseline": m(1, 100.0, 1.0), "chain": m(9.0, 330.0, 3.3),
                    "ngram": m(3.0, 180.0, 1.8), "suffix": m(5.5, 300.0, 3.0)},
        "best_model_free": "suffix", "prompts": {"set": "tiny_heldout", "limit": 40},
        "settings": {"max_new_tokens": 128}, "num_prompts": 40, "lossless": True,
        "mismatches": [], "config": {},
    }


def test_card_has_training_facts_engine_table_and_relative_paths(tmp_path):
    run = _run_dir(tmp_path)
    facts = run_facts(run / "checkpoints" / "last.ckpt")
    assert facts["command"] == "python train.py experiment=v6_muon trainer.max_epochs=12"
    assert facts["train_seconds"] == 120.0 and facts["tokens_seen"] == 3000.0
    assert facts["target"] == "artifacts/tiny/target"  # no build-machine path
    card = model_card("# DFlash drafter\n\nserve here\n", {"global_step": 3096}, facts,
                      _report(), "artifacts/tiny/drafter")
    assert card.startswith("# DFlash drafter for `artifacts/tiny/target`")
    assert "| **dflash (this drafter)** | 9.00 | 330.0 | 3.30x | 1.10x |" in card
    assert "| ngram | 3.00 | 180.0 | 1.80x | 0.60x |" in card
    assert "At 8 requests in flight" in card and "800.0 (1.60x)" in card
    assert "- steps: 3096" in card and "2.0 min of optimizer steps" in card
    assert "## Drafter\n\nserve here" in card
    assert "'methods=[chain,ngram,suffix]'" in card and "'vllm.concurrency=[1,8]'" in card


def test_card_report_must_be_an_engine_report(tmp_path):
    p = tmp_path / "report.json"
    p.write_text(json.dumps({"methods": {}}))
    with pytest.raises(UserError, match="not an engine report"):
        load_report(p)
    assert load_report(None) is None


def test_training_command_is_quoted_for_the_shell(tmp_path):
    """An override with shell metacharacters (a glob over shards) is pasted back as one word."""
    import shlex

    run = _run_dir(tmp_path)
    (run / ".hydra" / "overrides.yaml").write_text(
        "- experiment=v6_muon\n- 'data.path=\"artifacts/x/shard-*[036].parquet\"'\n")
    cmd = run_facts(run / "checkpoints" / "last.ckpt")["command"]
    assert shlex.split(cmd)[2:] == ["experiment=v6_muon", 'data.path="artifacts/x/shard-*[036].parquet"']
