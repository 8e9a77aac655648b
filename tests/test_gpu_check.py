"""bench/gpu_check.py's argument handling and plumbing, on CPU: without CUDA it stops with one
line and status 2; ``--dry-run`` runs its attention and training-step checks at tiny shapes
and writes its result files (~15 s on one thread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from train_utils import REPO


def run_check(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path,
               WANDB_MODE="disabled")
    return subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=180)


def test_without_cuda_exits_2_with_one_line(tmp_path):
    p = run_check(["--quick", "--out", str(tmp_path)], tmp_path)
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "no CUDA device" in err[0] and "--dry-run" in err[0]
    assert not list(tmp_path.iterdir())  # nothing written


def test_dry_run_writes_its_results(tmp_path):
    out = tmp_path / "res"
    p = run_check(["--dry-run", "--quick", "--skip-train", "--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["dry_run"] and res["device"] == "cpu" and "resume" not in res
    assert res["checks"] == {"attention": True, "step": True}
    paths = [r["path"] for r in res["attention"]["rows"]]
    assert paths == ["dense SDPA (baseline)", "flex eager", "flex compiled"]
    assert "fwd_bwd_ms" in res["attention"]["rows"][0]  # dense: forward + backward
    assert all("fwd_bwd_ms" not in r for r in res["attention"]["rows"][1:])  # flex: CPU forward
    assert "backward skipped on CPU" in res["attention"]["note"]
    steps = res["step"]["rows"]
    assert [r["drafter_layers"] for r in steps] == [1, 5]
    assert all(r["step_s"] > 0 and r["tok_s"] > 0 and 0 < r["mfu"] for r in steps)
    assert "### training step" in (out / "gpu_check.md").read_text()
    assert "attention: PASS" in p.stdout and "step: PASS" in p.stdout
