"""``features=vllm``: the feature cache built by vLLM (extract_hidden_states + the project's
connector) holds what the HF forward's cache holds, trains the same, and resumes a killed build.

The engine tests need vLLM (the ``engine`` extra); ``DFLASH_REQUIRE_ENGINE=1`` (CI) turns a
missing engine into a failure instead of a skip.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from train_utils import REPO, base_overrides, make_shards, run_train

from dflash_lit.data.features import FeatureStore, to_tensor
from dflash_lit.data.vllm_features.rows import RowHeads, capture_ids, check_vllm_version
from dflash_lit.errors import UserError
from dflash_lit.model.target import FrozenTarget

TINY = REPO / "artifacts" / "tiny" / "target"


def _require_engine() -> None:
    if importlib.util.find_spec("vllm") is None and os.environ.get("DFLASH_REQUIRE_ENGINE") != "1":
        pytest.skip("vLLM not installed (bash scripts/install_engine.sh)")


def test_capture_ids_shift_by_one_and_add_the_last_layer():
    assert capture_ids([1, 3, 5, 7], 8) == [2, 4, 6, 8]
    assert capture_ids([0, 2], 8) == [1, 3, 8]
    with pytest.raises(ValueError, match=r"layer ids \[8\] out of range .* 8 decoder layers"):
        capture_ids([1, 8], 8)


def test_an_untested_vllm_is_refused_in_one_line():
    with pytest.raises(RuntimeError, match=r"vLLM 0\.1\.0 is not supported \(tested: 0\.32\.0\)"):
        check_vllm_version("0.1.0")


def test_row_heads_turn_engine_states_into_the_hf_cache_row():
    """Fed HF's states in the engine's numbering (input of layer j, the last one before the
    final norm), RowHeads gives FrozenTarget's context layers (id L-1 after the norm), greedy
    ids and top-k logits."""
    layer_ids = [1, 4, 7]
    target = FrozenTarget.from_pretrained(TINY, layer_ids)
    ids = torch.randint(2, 4000, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = target.model(ids, output_hidden_states=True)
        # HF overwrites its last entry with the final-norm output: recompute the raw one
        pre_norm = {}
        h = target._layers[7].register_forward_hook(
            lambda m, a, o: pre_norm.setdefault("x", o[0] if isinstance(o, tuple) else o))
        ref = target(ids)
        h.remove()
    states = [hf.hidden_states[j] if j < 8 else pre_norm["x"] for j in capture_ids(layer_ids, 8)]
    heads = RowHeads(TINY, layer_ids, 8, torch.float32, topk=5, chunk_tokens=16)
    row = heads.row(torch.stack([s[0] for s in states], dim=1))
    torch.testing.assert_close(row.hidden, ref.hidden[0], rtol=0, atol=1e-5)
    assert torch.equal(row.argmax, ref.logits[0].argmax(-1))
    torch.testing.assert_close(row.topk_logits, ref.logits[0].topk(5, -1).values, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------- with the engine
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("vdata")
    return make_shards(root / "train", n=24, vocab=512), make_shards(root / "val", n=6, vocab=512,
                                                                     seed=1)


def _ov(tmp: Path, data, *extra: str) -> list[str]:
    train, val = data
    ov = [o for o in base_overrides(tmp, train, val) if not o.startswith("target=")]
    return ov + ["target=tiny", "experiment=v5_hardce", "trainer.max_steps=6",
                 "schedule.noise.peak=0.05", "features.dtype=float32",
                 "drafter.target_layer_ids=[1,3,5,7]", *extra]


VLLM = ("features=vllm", "features.engine.enforce_eager=true", "features.engine.max_num_seqs=8",
        "features.engine.memory_fraction=0.1")


def _losses(run_dir: Path, key: str = "train/main/loss") -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}


def _store(root: Path, engine: bool) -> FeatureStore:
    for d in sorted((root / "outputs" / "features").iterdir()):
        if (d / "manifest.json").is_file():
            st = FeatureStore(d)
            if ("engine" in st.manifest["fingerprint"]) == engine and len(st) == 24:
                return st
    raise AssertionError(f"no {'vLLM' if engine else 'HF'} train cache under {root}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """The same run trained from an HF-built and from a vLLM-built cache (float32 storage)."""
    _require_engine()
    tmp = tmp_path_factory.mktemp("vruns")
    run_train(_ov(tmp, data, "features=cache"), tmp / "hf")
    run_train(_ov(tmp, data, *VLLM), tmp / "vllm")
    return tmp


def test_vllm_cache_equals_the_hf_cache(runs):
    hf, vl = _store(runs, engine=False), _store(runs, engine=True)
    assert vl.manifest["fingerprint"]["engine"]["name"] == "vllm"
    worst, agree, total = 0.0, 0, 0
    for r, n in hf._lengths.items():
        assert vl._lengths[r] == n
        worst = max(worst, float((to_tensor(hf.hidden(r, n)) - to_tensor(vl.hidden(r, n)))
                                 .abs().max()))
        agree += int((hf.argmax(r, n) == vl.argmax(r, n)).sum())
        total += n
    assert worst < 1e-4, worst
    assert agree / total >= 0.999, agree / total


def test_training_from_the_vllm_cache_matches_within_2_percent(runs):
    a, b = _losses(runs / "hf"), _losses(runs / "vllm")
    assert sorted(a) == sorted(b) == list(range(6))
    for s in a:
        assert abs(a[s] - b[s]) <= 0.02 * abs(a[s]), (s, a[s], b[s])


def test_data_parallel_ranks_get_their_own_devices(monkeypatch):
    from dflash_lit.data.vllm_features.build import rank_envs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert rank_envs(1, 1) == [{}]
    assert rank_envs(2, 2) == [{"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                               {"VLLM_CPU_OMP_THREADS_BIND": "2|3"}]
    assert rank_envs(1, 2) == [{"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}]
    with pytest.raises(UserError, match=r"data_parallel_size=3 x tensor_parallel_size=2 needs 6 "
                                        r"CPU cores; 5 available"):
        rank_envs(3, 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert rank_envs(2, 2) == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    with pytest.raises(UserError, match=r"needs 8 GPUs; 4 visible"):
        rank_envs(4, 2)


def test_two_data_parallel_engines_build_the_same_cache(tmp_path, data, runs):
    """features.engine.data_parallel_size=2: two engines (one core each here) split the rows;
    the cache holds what one engine's holds."""
    _require_engine()
    run_train(_ov(tmp_path, data, *VLLM, "features.engine.data_parallel_size=2",
                  "trainer.max_steps=1"), tmp_path / "dp2")
    st, ref = _store(tmp_path, engine=True), _store(runs, engine=True)
    assert st.manifest["fingerprint"]["engine"]["data_parallel_size"] == 2
    assert {p.name.split("-")[1] for p in st.path.glob("part-*.arrow")} == {"000r0", "000r1"}
    assert st._lengths == ref._lengths
    for r, n in ref._lengths.items():
        assert float((to_tensor(st.hidden(r, n)) - to_tensor(ref.hidden(r, n))).abs().max()) < 1e-5
        assert np.array_equal(st.argmax(r, n), ref.argmax(r, n))


def test_a_killed_build_resumes_from_its_committed_parts(tmp_path, data, runs):
    """kill -9 of the trainer mid-build: the engine dies with it, the rerun keeps the committed
    parts, sends only the rest, and the finished cache holds the same rows and numbers."""
    _require_engine()
    ov = _ov(tmp_path, data, *VLLM, "features.part_mb=1", "trainer.max_steps=1",
             "features.engine.max_num_seqs=1")
    engines_before = _engine_processes()
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *ov,
                             f"hydra.run.dir={tmp_path / 'killed'}"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    builds = tmp_path / "outputs" / "features"
    t0 = time.time()
    while time.time() - t0 < 300 and proc.poll() is None:
        if len(list(builds.glob(".*.vllm-build/part-*.arrow"))) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the build finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    build = next(builds.glob(".*.vllm-build"))
    time.sleep(2)
    before = sorted(p.name for p in build.glob("part-*"))
    time.sleep(3)
    assert sorted(p.name for p in build.glob("part-*")) == before, \
        "the engine outlived the killed trainer"
    t0 = time.time()  # and no engine process is left holding the model
    while _engine_processes() > engines_before and time.time() - t0 < 20:
        time.sleep(0.5)
    assert _engine_processes() <= engines_before, "vLLM processes outlived the killed trainer"
    run_train(ov, tmp_path / "resumed")
    st, ref = _store(tmp_path, engine=True), _store(runs, engine=True)
    assert len({p.name.split("-")[1] for p in st.path.glob("part-*.arrow")}) == 2  # two attempts
    for r, n in ref._lengths.items():
        assert np.array_equal(st.hidden(r, n), ref.hidden(r, n)) or float(
            (to_tensor(st.hidden(r, n)) - to_tensor(ref.hidden(r, n))).abs().max()) < 1e-5
        assert np.array_equal(st.argmax(r, n), ref.argmax(r, n))


def _engine_processes() -> int:
    out = subprocess.run(["pgrep", "-f", "VLLM::"], capture_output=True, text=True).stdout
    return len(out.split())


def test_a_random_target_is_refused_for_features_vllm(tmp_path, data):
    train, val = data
    ov = base_overrides(tmp_path, train, val) + ["experiment=v5_hardce", "features=vllm"]
    with pytest.raises(UserError, match=r"features=vllm: the engine serves a model directory; "
                                        r"set target.path"):
        run_train(ov, tmp_path / "r")
