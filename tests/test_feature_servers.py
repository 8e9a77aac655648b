"""``features=vllm_server``: training from running feature servers (``serve_features.py``).

Without the engine: the sampler's look-ahead is what it then hands out; an unreachable
server, a server computing other features, and loader workers are refused before training in
one line each. With the engine (vLLM; ``DFLASH_REQUIRE_ENGINE=1`` makes a missing one fail):
kill -9 of the server mid-run stops the run with ``last.ckpt`` at the last complete step and
the resumed run ends where the uninterrupted one does.
"""

from __future__ import annotations

import csv
import http.server
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from train_utils import REPO, base_overrides, drafter_state, make_shards, run_train

from dflash_lit.data.bucketing import BucketBatchSampler
from dflash_lit.errors import UserError

STEPS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_upcoming_batches_are_the_ones_handed_out_next_across_epochs():
    lengths = np.random.default_rng(0).integers(10, 60, size=50)
    s = BucketBatchSampler(lengths, token_budget=200, num_buckets=3, seed=3)
    it = iter(s)
    for _ in range(len(s) - 2):  # two batches before the epoch ends
        next(it)
    ahead = s.upcoming(5)
    got = [next(it), next(it)]
    assert next(it, None) is None
    s.set_epoch(1)
    got += [b for b, _ in zip(iter(s), range(3))]
    assert ahead == got


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdata")
    return make_shards(root / "train", n=24, vocab=512), make_shards(root / "val", n=4,
                                                                     vocab=512, seed=1)


def _ov(tmp: Path, data, url: str, *extra: str) -> list[str]:
    train, val = data
    ov = [o for o in base_overrides(tmp, train, val) if not o.startswith("target=")]
    return ov + ["target=tiny", "experiment=v5_hardce", f"trainer.max_steps={STEPS}",
                 "drafter.target_layer_ids=[1,3,5,7]", "features=vllm_server",
                 f"features.urls=[{url}]", "features.retries=2", "features.retry_wait_s=0.5",
                 "features.timeout_s=20", "features.ahead=2", "trainer.limit_val_batches=0",
                 *extra]


def test_an_unreachable_server_is_named_before_training(tmp_path, data):
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(UserError, match=rf"features.urls: feature server {url} is unreachable"):
        run_train(_ov(tmp_path, data, url), tmp_path / "r")
    assert not (tmp_path / "r" / "checkpoints").exists()


class _Info(http.server.BaseHTTPRequestHandler):
    body = b"{}"

    def do_GET(self):  # noqa: N802 - http.server API
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


def test_a_server_of_other_layer_ids_or_another_model_is_refused(tmp_path, data):
    from dflash_lit.train.feature_servers import served_fingerprint
    from dflash_lit.train.run import compose_train

    url_ov = "http://127.0.0.1:1"
    cfg = compose_train(_ov(tmp_path, data, url_ov), tmp_path / "c")
    good = served_fingerprint(cfg, [1, 3, 5, 7], 0)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Info)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        for change, what in [({"layer_ids": [2, 3, 5, 7]}, "layer_ids"),
                             ({"target": {**good["target"], "weights": {"x": "y"}}}, "target")]:
            _Info.body = json.dumps({"fingerprint": {**good, **change}}).encode()
            with pytest.raises(UserError, match=rf"features.urls: {url} serves other features "
                                                rf"than this run needs \({what} differ"):
                run_train(_ov(tmp_path, data, url), tmp_path / what)
    finally:
        srv.shutdown()


def test_loader_workers_are_refused(tmp_path, data):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Info)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(UserError, match=r"data.num_workers=2: features=vllm_server fetches "
                                            r"ahead in the main process"):
            run_train(_ov(tmp_path, data, f"http://127.0.0.1:{srv.server_address[1]}",
                          "data.num_workers=2"), tmp_path / "w")
    finally:
        srv.shutdown()


# ---------------------------------------------------------------------------- with the engine
def _require_engine() -> None:
    if importlib.util.find_spec("vllm") is None and os.environ.get("DFLASH_REQUIRE_ENGINE") != "1":
        pytest.skip("vLLM not installed (bash scripts/install_engine.sh)")


class Server:
    """``serve_features.py`` on a free loopback port, in its own process group."""

    def __init__(self, tmp: Path, data, port: int) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        ov = _ov(tmp, data, self.url, "features.engine.enforce_eager=true",
                 "features.engine.memory_fraction=0.1", "features.engine.max_num_seqs=8",
                 f"features.serve.port={port}", f"hydra.run.dir={tmp / f'server{port}'}")
        self.log_path = tmp / f"server{port}.log"
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, str(REPO / "serve_features.py"), *ov],
                                     cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t0 = time.time()
        while time.time() - t0 < 240:
            assert self.proc.poll() is None, (tmp / f"server{port}.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{self.url}/dflash/info", timeout=2).read()
                return
            except OSError:
                time.sleep(1)
        raise AssertionError("the feature server did not come up")

    def requests(self) -> int:
        """Rows requested from this server so far (its access log)."""
        return self.log_path.read_text(errors="replace").count("POST /v1/completions")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def _train(ov: list[str], cwd: Path) -> tuple[int, str]:
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, str(REPO / "train.py"), *ov], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr


def _losses(run: Path) -> dict[int, float]:
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/main/loss"]) for r in csv.DictReader(f)
                if r.get("train/main/loss")}


def test_a_killed_server_stops_the_run_at_a_checkpoint_and_resume_is_exact(tmp_path, data):
    _require_engine()
    server = Server(tmp_path, data, _free_port())
    try:
        straight = tmp_path / "straight"
        rc, out = _train(_ov(tmp_path, data, server.url, f"hydra.run.dir={straight}"), tmp_path)
        assert rc == 0, out[-3000:]
        run = tmp_path / "killed"
        ov = _ov(tmp_path, data, server.url, f"hydra.run.dir={run}")
        env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
        served = server.requests()  # the straight run's
        p = subprocess.Popen([sys.executable, str(REPO / "train.py"), *ov], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t0 = time.time()  # kill the server once training is under way (a few batches served)
        while server.requests() - served < 20 and time.time() - t0 < 300 and p.poll() is None:
            time.sleep(0.05)
        server.kill()
        out, _ = p.communicate(timeout=300)
    finally:
        server.kill()
    assert p.returncode == 2, out[-3000:]  # a user-facing stop, not a crash
    err = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and "no feature server answered" in err[0] and \
        "resume with ckpt_path=last once a server is back" in err[0], out[-2000:]
    ck = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    stopped = ck["global_step"]
    assert 0 < stopped < STEPS
    server = Server(tmp_path, data, server.port)  # back, on the same URL
    try:
        rc, out = _train(ov + ["ckpt_path=last"], tmp_path)
    finally:
        server.kill()
    assert rc == 0, out[-3000:]
    a, b = _losses(straight), _losses(run)
    assert sorted(a) == sorted(b) == list(range(STEPS))
    for s in a:  # the engine batches rows differently run to run: fp32 last bits, bf16 storage
        assert abs(a[s] - b[s]) <= 1e-3 * abs(a[s]), (s, a[s], b[s])
    wa, wb = drafter_state(straight / "checkpoints" / "last.ckpt"), \
        drafter_state(run / "checkpoints" / "last.ckpt")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-4)
