"""One training run fed by several feature servers (``features=vllm_server``) on this machine:
two ``serve_features.py`` processes on loopback, one trainer listing both; how many rows each
server served, the run's training rows/s, and that the losses equal a run fed by one server.

    python bench/feature_servers.py [--steps 30] [--servers 2]

On a 2-core CPU the servers share the cores with the trainer: this shows the path (rows
spread over servers, one run), not a speed-up; on a cluster each server has its own GPUs.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import fmt_table, write_result

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(ov: list[str], port: int, tmp: Path) -> tuple[subprocess.Popen, Path]:
    log = tmp / f"server{port}.log"
    p = subprocess.Popen([sys.executable, str(ROOT / "serve_features.py"), *ov,
                          f"features.serve.port={port}", f"hydra.run.dir={tmp / str(port)}",
                          "features.engine.memory_fraction=0.08"], cwd=ROOT,
                         stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return p, log


def _wait(port: int, p: subprocess.Popen, log: Path) -> None:
    t0 = time.time()
    while time.time() - t0 < 300:
        if p.poll() is not None:
            raise RuntimeError(log.read_text()[-2000:])
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/dflash/info", timeout=2).read()
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"server {port} did not start")


def _train(ov: list[str], urls: list[str], run: Path) -> tuple[dict[int, float], float]:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "train.py"), *ov,
                    f"features.urls=[{','.join(urls)}]", "logger=csv", "callbacks=minimal",
                    f"hydra.run.dir={run}"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    secs = time.perf_counter() - t0
    with open(run / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/main/loss"]) for r in csv.DictReader(f)
                if r.get("train/main/loss")}, secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--overrides", nargs="*", default=["experiment=v5_hardce"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    ov = [*args.overrides, "features=vllm_server", f"trainer.max_steps={args.steps}",
          "trainer.limit_val_batches=0", "features.engine.enforce_eager=true",
          f"paths.log_dir={tmp}"]
    ports = [_port() for _ in range(args.servers)]
    procs = [_start(ov, p, tmp) for p in ports]
    try:
        for port, (p, log) in zip(ports, procs):
            _wait(port, p, log)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        served0 = [len(re.findall(r"POST /v1/completions", log.read_text(errors="replace")))
                   for _, log in procs]
        many, many_s = _train(ov, urls, tmp / "many")
        served = [len(re.findall(r"POST /v1/completions", log.read_text(errors="replace"))) - s0
                  for (_, log), s0 in zip(procs, served0)]
        one, one_s = _train(ov, urls[:1], tmp / "one")
    finally:
        for p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
    worst = max(abs(many[s] - one[s]) / abs(one[s]) for s in one)
    rows = [{"server": u, "rows served": n} for u, n in zip(urls, served)]
    table = fmt_table(rows) + (
        f"\n\n{args.steps} steps ({' '.join(args.overrides)}): {sum(served)} row requests over "
        f"{args.servers} servers, run wall {many_s:.0f} s ({one_s:.0f} s from one server); "
        f"losses vs the one-server run within {100 * worst:.3f}% at every step")
    write_result("feature_servers_tiny", {"servers": rows, "steps": args.steps,
                                          "wall_s_many": many_s, "wall_s_one": one_s,
                                          "max_rel_loss_diff": worst}, table)


if __name__ == "__main__":
    main()
