"""bench/soak.py at a small scale: a run killed at random moments (SIGKILL, SIGTERM, SIGUSR1)
and resumed with ``ckpt_path=last`` again and again ends in exactly the state of the same run
left alone, with every logged loss equal, no partial file and no orphan process left. The
2000-step soak of the default experiment is recorded in docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from train_utils import REPO, base_overrides, make_shards


def test_soak_driver_kill_resume_chain_is_exact(tmp_path):
    train, val = make_shards(tmp_path / "train", n=40), make_shards(tmp_path / "val", n=6, seed=1)
    ov = [o for o in base_overrides(tmp_path, train, val) if not o.startswith("paths.log_dir")]
    env = dict(os.environ, WANDB_MODE="disabled")
    cmd = [sys.executable, str(REPO / "bench" / "soak.py"), "--steps", "40", "--every", "5",
           "--kill-every", "6", "12", "--seed", "2", "--interval", "0.3", "--orphan-wait", "1",
           "--workdir", str(tmp_path / "work"), "--results", str(tmp_path / "res"),
           "--name", "soak_test", "--overrides", *ov]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    res = json.loads((tmp_path / "res" / "soak_test.json").read_text())
    s = res["summary"]
    assert s["identical_final_state"] and res["final_state"]["global_step"] == [40, 40]
    assert res["final_state"]["optimizer"]["leaves"] > 0 and res["final_state"]["optimizer"]["differ"] == 0
    assert s["loss_steps_compared"] == 40 and s["loss_steps_differing"] == 0
    assert s["launches"] >= 3 and sum(s["kills"].values()) >= s["launches"] - 1
    assert s["kills"].get("SIGKILL", 0) >= 1
    assert res["leftovers"]["soak"]["partial_temporaries"] == [] and s["orphan_processes"] == 0
    assert (tmp_path / "res" / "soak_test_rss.png").stat().st_size > 10_000
