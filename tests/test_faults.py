"""Fault injection for real: signals to a training subprocess, SIGKILL during a checkpoint
write, truncated checkpoints on disk. Every fault must leave a run that resumes exactly."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_utils import REPO, base_overrides, drafter_state, make_shards

STEPS = 24  # total optimizer steps of every run here (several epochs of the 40-row data)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults_data")
    return make_shards(root / "train", n=40), make_shards(root / "val", n=6, seed=1)


def _overrides(tmp: Path, data, *extra: str) -> list[str]:
    return base_overrides(tmp, *data) + [f"trainer.max_steps={STEPS}", "trainer.limit_val_batches=0",
                                         *extra]


def _popen(args: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run(args: list[str], cwd: Path, timeout: float = 300) -> tuple[int, str]:
    p = _popen(args, cwd)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def _run_dirs(tmp: Path) -> list[Path]:
    return sorted(p.parent for p in (tmp / "outputs").glob("*/*/.hydra"))


def _wait_for_line(p: subprocess.Popen, needle: str, timeout: float = 240) -> list[str]:
    lines, t0 = [], time.time()
    while time.time() - t0 < timeout:
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            break
        lines.append(line)
        if needle in line:
            return lines
    p.kill()
    raise AssertionError(f"{needle!r} never printed:\n{''.join(lines[-30:])}")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, data) -> Path:
    """The reference: STEPS steps without interruption (a subprocess, like every run here)."""
    tmp = tmp_path_factory.mktemp("straight")
    rc, out = _run(_overrides(tmp, data), tmp)
    assert rc == 0, out[-3000:]
    (run,) = _run_dirs(tmp)
    return run


@pytest.fixture(scope="module")
def straight(straight_run):
    return drafter_state(straight_run / "checkpoints" / "last.ckpt")


def _logged_losses(run: Path) -> list[tuple[int, str]]:
    """(step, train loss) of every CSV row that logged one, in file order."""
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return [(int(r["step"]), r["train/main/loss"]) for r in csv.DictReader(f)
                if r.get("train/main/loss")]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_signal_saves_at_step_boundary_and_resume_is_exact(tmp_path, data, straight, sig):
    ov = _overrides(tmp_path, data)
    p = _popen(ov, tmp_path)
    _wait_for_line(p, "step=5 ")
    p.send_signal(getattr(signal, sig))
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out[-3000:]  # a clean exit, not a crash
    assert f"{sig} received: saved" in out
    (run,) = _run_dirs(tmp_path)
    ck = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert 5 <= ck["global_step"] < STEPS  # stopped early, at a step boundary
    rc, out = _run(ov + ["ckpt_path=last"], tmp_path)  # the SLURM requeue / user restart
    assert rc == 0, out[-3000:]
    resumed = max(_run_dirs(tmp_path), key=lambda d: d.name)
    assert (resumed / "resumed_from.txt").read_text().strip().endswith("last.ckpt")
    got = drafter_state(resumed / "checkpoints" / "last.ckpt")
    assert got.keys() == straight.keys()
    for k in got:
        assert torch.equal(got[k], straight[k]), k


def test_last_in_a_fixed_run_dir_starts_fresh_then_resumes_itself(tmp_path, data, straight,
                                                                 straight_run):
    """A cluster job script: the same command, `hydra.run.dir=DIR ckpt_path=last`, launched
    again after each pre-emption. The first launch has nothing to resume and starts fresh with
    a warning; the relaunch continues DIR's own last.ckpt, bit-exactly, and DIR's metrics.csv
    ends holding every step's loss once, equal to the uninterrupted run's."""
    job = tmp_path / "job"
    cmd = _overrides(tmp_path, data, f"hydra.run.dir={job}", "ckpt_path=last")
    p = _popen(cmd, tmp_path)
    lines = _wait_for_line(p, "step=5 ")
    assert any(f"no checkpoints/last.ckpt in the run directory {job}" in line
               and "starting fresh" in line for line in lines), "".join(lines[-20:])
    p.send_signal(signal.SIGTERM)  # pre-empted after its first checkpoint
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out[-3000:]
    assert (job / "checkpoints" / "last.ckpt").is_file()
    rc, out = _run(cmd, tmp_path)
    assert rc == 0, out[-3000:]
    assert f"resuming from {job / 'checkpoints' / 'last.ckpt'}" in out
    got = drafter_state(job / "checkpoints" / "last.ckpt")
    assert got.keys() == straight.keys()
    for k in got:
        assert torch.equal(got[k], straight[k]), k
    assert _logged_losses(job) == _logged_losses(straight_run)
    # strict: nothing to resume is an error (one line, before any training)
    empty = tmp_path / "empty_job"
    rc, out = _run(_overrides(tmp_path, data, f"hydra.run.dir={empty}", "ckpt_path=last",
                              "resume_strict=true"), tmp_path)
    assert rc == 2 and "Traceback" not in out, out[-3000:]
    assert f"error: ckpt_path=last: no checkpoints/last.ckpt in the run directory {empty}" in out
    assert not (empty / "checkpoints").exists()


def test_sigkill_during_checkpoint_write_leaves_loadable_checkpoints(tmp_path, data, straight):
    """Checkpoint every step, SIGKILL the trainer while a temporary checkpoint file is being
    written: every *.ckpt on disk still loads, the tmp file is never taken for `last`, and
    ckpt_path=last resumes to the same weights as the uninterrupted run."""
    ov = _overrides(tmp_path, data, "callbacks.model_checkpoint.every_n_train_steps=1")
    p = _popen(ov, tmp_path)
    _wait_for_line(p, "step=4 ")
    ckdir = None
    t0 = time.time()
    while time.time() - t0 < 120 and p.poll() is None:
        dirs = _run_dirs(tmp_path)
        ckdir = dirs[0] / "checkpoints" if dirs else None
        if ckdir and ckdir.is_dir() and any(ckdir.glob(".*.tmp-*")):
            os.kill(p.pid, signal.SIGKILL)  # mid-write: the temporary file exists right now
            break
        time.sleep(0.0005)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, "the run ended before a write could be interrupted"
    assert any(ckdir.glob(".*.tmp-*"))  # the half-written file is there ...
    finished = sorted(ckdir.glob("*.ckpt"))
    assert any(f.name == "last.ckpt" for f in finished)
    for f in finished:  # ... but every real checkpoint name holds a complete checkpoint
        torch.load(f, map_location="cpu", weights_only=True)
    partial = list(ckdir.glob(".*.tmp-*"))
    rc, out = _run(ov + ["ckpt_path=last"], tmp_path)
    assert rc == 0, out[-3000:]
    # the resume deletes the dead writer's partial file (as large as a checkpoint), saying so
    assert not any(ckdir.glob(".*.tmp-*"))
    assert f"removed {partial[0]}: a partial checkpoint write of a killed run" in out
    resumed = max(_run_dirs(tmp_path), key=lambda d: d.name)
    got = drafter_state(resumed / "checkpoints" / "last.ckpt")
    for k in got:
        assert torch.equal(got[k], straight[k]), k


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, data):
    """(overrides, last.ckpt) of a finished 2-step run: the checkpoint the bad-resume tests start from."""
    tmp = tmp_path_factory.mktemp("two_step")
    ov = base_overrides(tmp, *data) + ["trainer.max_steps=2"]
    rc, out = _run(ov, tmp)
    assert rc == 0, out[-3000:]
    (run,) = _run_dirs(tmp)
    return ov, run / "checkpoints" / "last.ckpt"


def test_truncated_checkpoint_fails_before_training_with_one_line(tmp_path, two_step_run):
    ov, good = two_step_run
    bad = tmp_path / "truncated.ckpt"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    rc, out = _run(ov + [f"ckpt_path={bad}"], tmp_path)
    assert rc != 0
    assert f"checkpoint {bad} is corrupt or truncated" in out
    assert "step=" not in out  # failed before any training step
    rc, out = _run(ov + [f"ckpt_path={tmp_path}/missing.ckpt"], tmp_path)
    assert rc != 0 and "missing.ckpt" in out and "step=" not in out


def test_checkpoint_from_another_target_is_refused(tmp_path, two_step_run):
    ov, ck = two_step_run
    rc, out = _run(ov + ["target.build.num_layers=10", f"ckpt_path={ck}"], tmp_path)
    assert rc != 0 and "step=" not in out
    # the drafter's context layers follow the target's depth: the first field that differs
    assert f"{ck}: drafter 'main' has target_layer_ids=[1, 2, 3, 4, 5] in the checkpoint but " \
           "[1, 3, 4, 6, 7] in the config" in out


def _limit_file_size(max_bytes: int):
    """preexec_fn: files may not grow past ``max_bytes`` (EFBIG, like a full disk/quota)."""
    import resource

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get the OSError, not a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
    return apply


def test_checkpoint_write_failure_is_clear_and_keeps_earlier_checkpoints(tmp_path, data):
    ov = base_overrides(tmp_path, *data) + ["trainer.max_steps=4", "trainer.limit_val_batches=0"]
    rc, out = _run(ov, tmp_path)
    assert rc == 0, out[-3000:]
    (run,) = _run_dirs(tmp_path)
    last = run / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    # resume with a file-size limit below one checkpoint: the next save must fail cleanly
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(REPO / "train.py"), *ov, "trainer.max_steps=6",
                        f"ckpt_path={last}"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300, preexec_fn=_limit_file_size(len(before) // 2))
    assert p.returncode != 0
    err = p.stdout + p.stderr
    assert "could not write checkpoint" in err and "File too large" in err, err[-3000:]
    assert "the previous checkpoints in that directory are intact" in err
    resumed = max(_run_dirs(tmp_path), key=lambda d: d.name)
    assert not list((resumed / "checkpoints").glob(".*.tmp-*"))  # no temporary left behind
    assert last.read_bytes() == before  # the earlier run's checkpoint is untouched
    torch.load(last, map_location="cpu", weights_only=True)


def test_shard_write_failure_keeps_finished_shards_and_rerun_completes(tmp_path):
    """write_shards under a file-size limit: the small first shard lands, a large one fails
    with a clear error, nothing half-written remains; a rerun without the limit completes."""
    script = """
import sys, numpy as np
from dflash_lit.data.shards import write_shards
rng = np.random.default_rng(0)
rows = [{"id": f"r{i}", "source": "s", "input_ids": rng.integers(4, 4000, n).tolist(),
         "loss_mask": [0] * 4 + [1] * (n - 4)}
        for i, n in enumerate([48] * 8 + [3000] * 16)]
write_shards(rows, sys.argv[1], rows_per_shard=8)
"""
    out = tmp_path / "shards"
    p = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True,
                       timeout=120, preexec_fn=_limit_file_size(16 * 1024))  # shard 0: ~3 KB, 1: ~50 KB
    assert p.returncode != 0
    assert "could not write shard" in p.stderr and "File too large" in p.stderr, p.stderr[-2000:]
    assert not list(out.glob(".*.tmp*"))  # no half-written shard
    from dflash_lit.data.shards import load_shards

    landed = sorted(out.glob("*.parquet"))
    assert [f.name for f in landed] == ["shard-00000.parquet"]
    ds, _ = load_shards(landed[0], vocab_size=4096, min_completion_tokens=1)
    assert len(ds) == 8
    p = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    ds, _ = load_shards(out, vocab_size=4096, min_completion_tokens=1)
    assert len(ds) == 24


def test_stale_temporaries_only_of_dead_local_writers_are_removed(tmp_path):
    """A live writer's temporary (a concurrent save) and another host's are never touched."""
    from dflash_lit.atomic import remove_stale_temporaries, temporary_name

    final = tmp_path / "last.ckpt"
    mine = temporary_name(final)  # this (live) process
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = temporary_name(final, pid=dead.pid)
    remote = tmp_path / f".last.ckpt.tmp-otherhost-{dead.pid}"
    for f in (mine, stale, remote):
        f.write_bytes(b"partial")
    assert remove_stale_temporaries([tmp_path]) == [stale]
    assert mine.exists() and remote.exists() and not stale.exists()


def test_directories_are_published_whole_and_a_killed_build_is_cleaned_up(tmp_path):
    """Built directories (a target, a feature cache) use the same temporary names as files:
    a dead builder's partial directory goes at the next start, and ``publish_dir`` swaps a
    finished one in with its files' sha256 in build_info.json."""
    import hashlib

    from dflash_lit.atomic import publish_dir, remove_stale_temporaries, temporary_name

    out = tmp_path / "target"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    partial = temporary_name(out, pid=dead.pid)
    (partial / "sub").mkdir(parents=True)
    (partial / "sub" / "weights").write_bytes(b"half")
    assert remove_stale_temporaries([tmp_path]) == [partial] and not partial.exists()
    for content in (b"v1", b"v2"):  # a first build, then a rebuild over it
        tmp = temporary_name(out)
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(content)
        info = publish_dir(tmp, out, {"name": "t"})
        assert not tmp.exists() and (out / "model.safetensors").read_bytes() == content
        rec = json.loads((out / "build_info.json").read_text())
        assert rec == info and rec["files"]["model.safetensors"] == {
            "sha256": hashlib.sha256(content).hexdigest(), "bytes": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no leftovers


def test_unwritable_checkpoint_directory_fails_clearly(tmp_path, data):
    """The checkpoint directory cannot be created (a file is in the way; permissions are no
    barrier to root, ENOTDIR takes the same path as EACCES/EROFS): one error naming it."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    ov = base_overrides(tmp_path, *data) + [
        "trainer.max_steps=2", "trainer.limit_val_batches=0",
        f"callbacks.model_checkpoint.dirpath={blocker}/ckpts"]
    rc, out = _run(ov, tmp_path)
    assert rc != 0
    assert f"could not create {blocker}/ckpts for checkpoint last.ckpt: Not a directory" in out
