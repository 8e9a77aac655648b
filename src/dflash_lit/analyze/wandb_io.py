"""W&B history → the same per-step DataFrame as the CSV logs.

Offline runs: ``run-<id>.wandb`` is a LevelDB-style log of ``wandb_internal_pb2.Record``
protos. wandb ≤ 0.17 shipped a Python reader (``wandb.sdk.internal.datastore.DataStore``);
0.31 moved it into the Go ``wandb-core`` binary, so the (small, stable) framing is read here
and each record is parsed with wandb's own ``Record`` proto. Framing: a 7-byte file header
(``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte header
(CRC32 of type byte + data, length, type FULL/FIRST/MIDDLE/LAST); a block tail shorter than a
chunk header is zero padding.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from dflash_lit.analyze.steps import LogError, merge_steps

_BLOCK = 32 * 1024
_HDR = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_STEP_KEYS = ("trainer/global_step", "_step")  # Lightning's step first, W&B's counter second


def iter_wandb_records(path: str | Path) -> Iterator[bytes]:
    """Raw record payloads of a ``.wandb`` file; stops quietly at a truncated tail."""
    data = Path(path).read_bytes()
    if len(data) < _HDR or data[:4] != b":W&B":
        raise LogError(f"{path}: not a W&B transaction log (no ':W&B' header)")
    ident, magic, version = struct.unpack("<4sHB", data[:_HDR])
    if magic != 0xBEE1 or version != 0:
        raise LogError(f"{path}: unknown W&B log magic/version {magic:#x}/{version}")
    pos, pending = _HDR, None
    while pos < len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HDR:  # zero padding at the end of a block
            pos += left
            continue
        if pos + _HDR > len(data):
            return
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HDR])
        chunk = data[pos + _HDR:pos + _HDR + length]
        pos += _HDR + length
        if kind == 0 and length == 0:
            continue
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            return  # cut off mid-write (a live or crashed run): keep what came before
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE and pending is not None:
            pending += chunk
        elif kind == _LAST and pending is not None:
            yield pending + chunk
            pending = None


def _value(js: str) -> float:
    try:
        v = json.loads(js)
    except ValueError:
        return math.nan
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):  # W&B encodes non-finite floats as strings
        try:
            return float(v)
        except ValueError:
            return math.nan
    return math.nan  # media, histograms, tables: not a scalar metric


def history_rows_to_frame(rows: list[dict[str, float]]) -> pd.DataFrame:
    """History dicts (one per W&B ``log`` call) → merged per-step frame with a ``step`` column."""
    if not rows:
        return pd.DataFrame(columns=["step"])
    raw = pd.DataFrame(rows)
    step = None
    for k in _STEP_KEYS:
        if k in raw.columns:
            step = raw[k] if step is None else step.fillna(raw[k])
    raw["step"] = step
    raw = raw.drop(columns=[c for c in raw.columns if c.startswith("_") or c in _STEP_KEYS])
    df = merge_steps(raw)
    cols = ["step"] + (["epoch"] if "epoch" in df.columns else [])
    return df[cols + sorted(c for c in df.columns if c not in cols)]


def read_wandb_history(path: str | Path) -> list[dict[str, float]]:
    """Scalar history rows of one ``.wandb`` file (keys joined with '/' when nested)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for payload in iter_wandb_records(path):
        rec = pb.Record()
        try:
            rec.ParseFromString(payload)
        except Exception:  # a corrupt record must not stop the analysis
            continue
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in rec.history.item:
            key = "/".join(item.nested_key) if item.nested_key else item.key
            row[key] = _value(item.value_json)
        if rec.history.HasField("step") and "_step" not in row:
            row["_step"] = float(rec.history.step.num)
        rows.append(row)
    return rows


def load_wandb_offline(dirs: list[Path]) -> pd.DataFrame:
    """History of W&B offline run dirs (``offline-run-*``, in order) as one per-step frame."""
    rows: list[dict[str, float]] = []
    for d in dirs:
        files = sorted(Path(d).glob("run-*.wandb")) if Path(d).is_dir() else [Path(d)]
        if not files:
            raise LogError(f"{d}: no run-*.wandb file in this W&B offline run dir")
        for f in files:
            rows += read_wandb_history(f)
    df = history_rows_to_frame(rows)
    if df.empty:
        raise LogError(f"{dirs[0]}: the W&B log holds no history rows (did the run log?)")
    return df


def load_wandb_api(spec: str) -> tuple[pd.DataFrame, dict, str]:
    """``entity/project/run_id`` from the W&B server (needs network and an API key)."""
    parts = spec.strip("/").split("/")
    if len(parts) != 3 or not all(parts):
        raise LogError(f"wandb:{spec}: expected wandb:entity/project/run_id")
    try:
        import wandb

        api = wandb.Api(timeout=30)
        run = api.run("/".join(parts))
        rows = [{k: _value(json.dumps(v)) for k, v in r.items()}
                for r in run.scan_history(page_size=1000)]
    except Exception as e:  # auth and network errors differ across versions
        raise LogError(
            f"wandb:{spec}: could not read the run from the W&B server ({type(e).__name__}: "
            f"{e}). It needs network access and an API key (`wandb login` or WANDB_API_KEY); "
            "offline, pass the run's wandb/offline-run-* directory instead."
        ) from e
    df = history_rows_to_frame(rows)
    cfg = {k: v for k, v in dict(run.config).items() if not str(k).startswith("_")}
    return df, cfg, f"{parts[1]}/{parts[2]}"
