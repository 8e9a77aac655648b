"""DDP on CPU for real: 2 processes (gloo, ddp_spawn) train, shard data, sync metrics, resume
exactly, and a failing rank ends the whole run with its error instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_utils import REPO, base_overrides, make_shards

STEPS = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp_data")
    return make_shards(root / "train", n=48), make_shards(root / "val", n=8, seed=1)


def _run(args: list[str], cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _ddp(tmp: Path, data, rec: Path, *extra: str) -> list[str]:
    return base_overrides(tmp, *data) + [
        "trainer=ddp_cpu", f"trainer.max_steps={STEPS}", "trainer.val_check_interval=3",
        "trainer.check_val_every_n_epoch=null",
        "callbacks.model_checkpoint.every_n_train_steps=3",
        "+callbacks.rec._target_=train_utils.RankRecorder", f"+callbacks.rec.out={rec}", *extra]


def _ranks(rec: Path) -> list[dict]:
    return [json.loads((rec / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_two_process_ddp_trains_shards_syncs_and_resumes_exactly(tmp_path, data):
    p = _run(_ddp(tmp_path, data, tmp_path / "rec_straight"), tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    r0, r1 = _ranks(tmp_path / "rec_straight")
    assert r0["digest"] == r1["digest"]  # identical drafter weights on both ranks
    assert len(r0["rows"]) > 10 and len(r1["rows"]) > 10
    for e in {ep for ep, _ in r0["rows"]}:  # each epoch: the ranks' rows never overlap
        a = {i for ep, i in r0["rows"] if ep == e}
        b = {i for ep, i in r1["rows"] if ep == e}
        assert a and b and not a & b, e
    # validation metrics are reduced across ranks: both ranks hold the same synced numbers
    assert "val/main/acc" in r0["val"] and r0["val"] == r1["val"]
    # resume the 2-process run from its step-3 checkpoint: same final weights
    ckpt = next((tmp_path / "outputs").glob("*/*/checkpoints/step0000003.ckpt"))
    p = _run(_ddp(tmp_path, data, tmp_path / "rec_resumed", f"ckpt_path={ckpt}"), tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    q0, q1 = _ranks(tmp_path / "rec_resumed")
    assert q0["digest"] == q1["digest"] == r0["digest"]
    # the resumed ranks trained on exactly the rows the straight ranks saw after step 3
    n0 = len(r0["rows"]) - len(q0["rows"])
    assert q0["rows"] == r0["rows"][n0:] and q1["rows"] == r1["rows"][len(r1["rows"]) - len(q1["rows"]):]
    # onto one process: refused before training, naming both world sizes
    one = [o for o in _ddp(tmp_path, data, tmp_path / "rec_one", f"ckpt_path={ckpt}")
           if o != "trainer=ddp_cpu"]
    p = _run(one, tmp_path)
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stderr[-3000:]
    assert f"ckpt_path={ckpt}: saved with world size 2, this run has world size 1 " in err[0]
    assert "resume with 2 processes" in err[0]
    assert not (tmp_path / "rec_one").exists()  # no training step ran


def test_a_one_process_checkpoint_is_refused_by_two_processes(tmp_path, data):
    one = [o for o in _ddp(tmp_path, data, tmp_path / "rec_one") if o != "trainer=ddp_cpu"]
    p = _run(one, tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    ckpt = next((tmp_path / "outputs").glob("*/*/checkpoints/last.ckpt"))
    p = _run(_ddp(tmp_path, data, tmp_path / "rec_two", f"ckpt_path={ckpt}"), tmp_path)
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stderr[-3000:]
    assert "saved with world size 1, this run has world size 2 " in err[0]
    assert not (tmp_path / "rec_two").exists()


def test_a_failing_rank_ends_the_run_with_its_error(tmp_path, data):
    p = _run(_ddp(tmp_path, data, tmp_path / "rec", "+callbacks.rec.fail_rank=1",
                  "+callbacks.rec.fail_step=2"), tmp_path, timeout=300)
    assert p.returncode != 0
    assert "injected failure on rank 1" in p.stdout + p.stderr
