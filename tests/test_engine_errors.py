"""``evaluate.py engine=vllm`` on bad input: one line each, and no report when the engine fails."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dflash_lit.errors import UserError
from dflash_lit.eval import vllm_engine
from dflash_lit.eval.report import EvalSettings
from dflash_lit.eval.suffix_engine import SuffixSettings
from dflash_lit.eval.vllm_engine import EngineError, EngineSettings, run_worker, speculative_config

ROOT = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _cfg(**kv):
    cfg = OmegaConf.load(ROOT / "conf" / "tools" / "evaluate.yaml")
    cfg.pop("hydra")
    return OmegaConf.merge(cfg, {"ckpt": str(ROOT / "artifacts/tiny/drafter"),
                                 "prompts": "tiny_heldout", "limit": 2, "max_new_tokens": 8,
                                 "progress": False, "plot": False, **kv})


def test_engine_not_installed_names_the_install_command(monkeypatch, tmp_path):
    from dflash_lit.eval.cli import evaluate_in_engine

    real = importlib.util.find_spec
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(UserError, match=r"engine=vllm: vLLM is not installed; install it with "
                                        r"pip install -e '\.\[engine\]'"):
        evaluate_in_engine(_cfg(), tmp_path)


def test_a_drafter_for_another_target_is_refused_before_the_engine_starts(tmp_path):
    from transformers import AutoTokenizer

    from dflash_lit.eval.cli import evaluate_in_engine
    from dflash_lit.tiny.random_targets import tiny_qwen3

    other = tmp_path / "other"
    tiny_qwen3(vocab_size=4096, hidden_size=64).save_pretrained(other)  # the drafter: 256
    AutoTokenizer.from_pretrained(ROOT / "artifacts/tiny/target").save_pretrained(other)
    if not HAS_VLLM:
        pytest.skip("vLLM not installed")
    with pytest.raises(UserError, match=r"hidden size: drafter hidden_size=256 but target hidden "
                                        r"size=64"):
        evaluate_in_engine(_cfg(target=str(other)), tmp_path / "out")
    assert not (tmp_path / "out" / "report.json").exists()


def test_engine_settings_and_methods_fail_in_one_line():
    with pytest.raises(UserError, match=r"vllm.concurrency=\[0\]"):
        EngineSettings(concurrency=[0]).validate()
    with pytest.raises(UserError, match=r"vllm.memory_fraction=1.5"):
        EngineSettings(memory_fraction=1.5).validate()
    with pytest.raises(UserError, match=r"vllm.repeats=0: rounds of every method"):
        EngineSettings(repeats=0).validate()
    with pytest.raises(UserError, match=r"ngram.rule=latest: vLLM drafts from the earliest"):
        speculative_config("ngram", EvalSettings(ngram_rule="latest"), None, 16)
    with pytest.raises(UserError, match=r"suffix.min_token_prob=2"):
        SuffixSettings(min_token_prob=2).validate()
    cfg = speculative_config("suffix", EvalSettings(), None, 16)
    assert cfg["num_speculative_tokens"] == 24 and cfg["suffix_decoding_max_tree_depth"] == 24


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_an_engine_that_dies_or_hangs_fails_the_evaluation_without_a_report(tmp_path):
    job = {"target": str(tmp_path / "missing"), "dtype": "float32", "prompts": [[1, 2], [3]],
           "max_tokens": 4, "concurrency": 1, "llm_kwargs": {}, "speculative_config": None}
    with pytest.raises(EngineError, match=r"vLLM \(chain_c1\) exited with code 1 after 0/2 "
                                          r"requests: .*no report written"):
        run_worker(job, tmp_path / "w", "chain_c1", timeout_s=300, progress=False,
                   env={"LD_PRELOAD": str(tmp_path / "absent_lib.so")})
    assert not (tmp_path / "w" / "chain_c1.result.json").exists()
    # the extra environment reached the worker: the loader names the library it could not preload
    assert "absent_lib.so" in (tmp_path / "w" / "chain_c1.log").read_text()
    with pytest.raises(EngineError, match=r"ran past vllm.timeout_s=0.5; stopped it"):
        run_worker(job, tmp_path / "w", "slow_c1", timeout_s=0.5, progress=False)


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_model_free_methods_need_no_drafter_but_a_target(tmp_path):
    from dflash_lit.eval.cli import evaluate_in_engine

    cfg = _cfg(methods=["ngram"])
    cfg.ckpt = "???"  # unset: the model-free methods run without a drafter
    with pytest.raises(UserError, match=r"no target: .*pass target=<HF dir or hub id>"):
        evaluate_in_engine(cfg, tmp_path)
    cfg.methods = ["chain"]
    with pytest.raises(Exception, match="ckpt"):  # chain needs the drafter: Hydra's missing value
        evaluate_in_engine(cfg, tmp_path)


def _engine_processes() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "VLLM::|dflash_lit.eval.vllm_worker"],
                         capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_a_killed_evaluation_leaves_no_engine_behind(tmp_path):
    """kill -9 of evaluate.py while its engine serves: the worker and every vLLM process it
    started go with it (none is left holding the model)."""
    before = _engine_processes()
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "evaluate.py"), "engine=vllm",
         f"ckpt={ROOT / 'artifacts/tiny/drafter'}", "prompts=tiny_heldout", "limit=40",
         "max_new_tokens=128", "dtype=float32", "methods=[ngram]", "progress=false",
         "plot=false", f"out={out}", "warmup=false", "+vllm.extra_args.enforce_eager=true"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not list(out.glob("engine_runs/*.progress")) and time.time() - t0 < 240:
        assert proc.poll() is None, "the evaluation ended before its engine served"
        time.sleep(0.2)
    started = _engine_processes() - before
    assert any("VLLM::" in Path(f"/proc/{p}/cmdline").read_text(errors="ignore")
               for p in started if Path(f"/proc/{p}").exists()), "no engine process seen"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.time()
    while _engine_processes() & started and time.time() - t0 < 30:
        time.sleep(0.5)
    assert not _engine_processes() & started, "engine processes outlived the killed evaluation"
    assert not (out / "report.json").exists()
