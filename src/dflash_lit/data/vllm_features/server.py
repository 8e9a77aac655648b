"""A vLLM server that hands out target features: ``serve_features.py`` (online mode).

The server is vLLM's own OpenAI server (``vllm.entrypoints.openai.api_server``) with the
``extract_hidden_states`` method, the project's connector in ``spool`` mode (each finished
request's cache row written to ``<spool>/<key>.arrow``) and one ASGI middleware adding two
routes to it:

* ``GET /dflash/info``: what this server computes (target fingerprint, layer ids, storage
  dtype, top-k, engine and version); a trainer refuses a server whose answer differs from its
  own config before training;
* ``GET /dflash/features/<key>``: the row of the completed request ``<key>`` (the Arrow file,
  feature-cache schema), deleted once sent; waits up to ``DFLASH_FEATURE_WAIT_S`` for the
  connector to write it.

A trainer asks for a row with ``POST /v1/completions`` (the row's token ids, one token,
``kv_transfer_params: {"dflash_row", "dflash_key"}``), then fetches it by key. Files nobody
fetched (a trainer that died) are deleted after ``DFLASH_FEATURE_TTL_S``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path
from typing import Any

SPOOL_ENV, WAIT_ENV, TTL_ENV = "DFLASH_FEATURE_SPOOL", "DFLASH_FEATURE_WAIT_S", "DFLASH_FEATURE_TTL_S"
SERVED_NAME = "dflash-target"  # the model name the server answers to
_KEY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_sweep = {"last": 0.0}


def _sweep_stale(spool: Path, ttl: float) -> None:
    now = time.time()
    if now - _sweep["last"] < 60:
        return
    _sweep["last"] = now
    for f in spool.glob("*.arrow"):
        try:
            if now - f.stat().st_mtime > ttl:
                f.unlink()
        except FileNotFoundError:
            pass


async def features_middleware(request, call_next):
    """The ``/dflash/*`` routes (see the module docstring); everything else goes to vLLM."""
    path = request.url.path
    if not path.startswith("/dflash/"):
        return await call_next(request)
    from fastapi.responses import JSONResponse, Response

    spool = Path(os.environ[SPOOL_ENV])
    if path == "/dflash/info":
        return JSONResponse(json.loads((spool / "info.json").read_text()))
    key = path.removeprefix("/dflash/features/")
    if not path.startswith("/dflash/features/") or not _KEY.match(key):
        return JSONResponse({"error": f"no route {path}"}, status_code=404)
    f = spool / f"{key}.arrow"
    deadline = time.monotonic() + float(os.environ.get(WAIT_ENV, "120"))
    while not f.exists():
        if time.monotonic() > deadline:
            return JSONResponse({"error": f"no features for {key}"}, status_code=404)
        await asyncio.sleep(0.005)
    body = f.read_bytes()
    f.unlink(missing_ok=True)
    _sweep_stale(spool, float(os.environ.get(TTL_ENV, "600")))
    return Response(body, media_type="application/vnd.apache.arrow.file")


def server_command(target: str, connector: dict[str, Any], capture: list[int], dtype: str,
                   host: str, port: int, engine: dict[str, Any]) -> list[str]:
    """The vLLM server's command line (``python -m vllm.entrypoints.openai.api_server ...``)."""
    import sys

    from dflash_lit.data.vllm_features.connector import kv_transfer_config
    from dflash_lit.data.vllm_features.worker import speculative_config

    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
           "--served-model-name", SERVED_NAME, "--dtype", dtype, "--host", host,
           "--port", str(port), "--seed", "0",
           "--speculative-config", json.dumps(speculative_config(capture)),
           "--kv-transfer-config", json.dumps(kv_transfer_config(connector)),
           "--middleware", f"{__name__}.features_middleware",
           "--tensor-parallel-size", str(engine["tensor_parallel_size"]),
           "--data-parallel-size", str(engine["data_parallel_size"]),
           "--gpu-memory-utilization", str(engine["memory_fraction"]),
           "--max-num-seqs", str(engine["max_num_seqs"])]
    if engine.get("max_model_len"):
        cmd += ["--max-model-len", str(engine["max_model_len"])]
    if engine.get("enforce_eager"):
        cmd.append("--enforce-eager")
    for k, v in (engine.get("extra_args") or {}).items():
        flag = "--" + str(k).replace("_", "-")
        if v is True:
            cmd.append(flag)
        elif v is not False and v is not None:
            cmd += [flag, v if isinstance(v, str) else json.dumps(v)]
    return cmd
