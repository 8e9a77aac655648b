"""Cached target features: what the frozen target computes for each data row, stored once.

Layout of a feature cache directory (one per data split)::

    manifest.json           format version, fingerprint (what the cache was made from), sizes
    part-00000.arrow ...    Arrow IPC files, memory-mapped on read; one row per data row:
        row      int64      the row's raw number in its shards (``ShardDataset.rows``)
        length   int32      tokens stored (the row's effective, possibly truncated, length)
        hidden   binary     [length, F] captured layers (F = K·d), bf16 or fp32, row-major
        argmax   binary     [length] int32: the target's greedy next token at each position
        topk_ids / topk_logits  binary, optional: [length, k] int32 / fp32 top-k logits

Reads are zero-copy: a row's bytes are a slice of the memory-mapped Arrow buffer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STORE_DTYPES = {"bfloat16": (torch.bfloat16, np.uint16), "float32": (torch.float32, np.float32)}


class FeatureCacheError(ValueError):
    """A feature cache that is missing, incomplete or made from something else."""


def feature_schema(topk: int) -> pa.Schema:
    fields = [pa.field("row", pa.int64()), pa.field("length", pa.int32()),
              pa.field("hidden", pa.large_binary()), pa.field("argmax", pa.binary())]
    if topk:
        fields += [pa.field("topk_ids", pa.binary()), pa.field("topk_logits", pa.binary())]
    return pa.schema(fields)


def check_store_dtype(name: str) -> tuple[torch.dtype, type]:
    if name not in _STORE_DTYPES:
        raise FeatureCacheError(
            f"data.features.dtype={name!r}: use one of {sorted(_STORE_DTYPES)}")
    return _STORE_DTYPES[name]


class FeatureWriter:
    """Appends rows to ``<prefix>-*.arrow`` files of about ``part_bytes`` each.

    A part is written under ``.partial`` and renamed when it is closed (at ``part_bytes``, on
    ``commit()`` and ``close()``), so a killed build leaves only whole parts under
    ``*.arrow`` (what a resumed build keeps). ``prefix`` must start with ``part``.
    """

    def __init__(self, out_dir: Path, feature_dim: int, dtype: str, topk: int = 0,
                 part_bytes: int = 256 << 20, prefix: str = "part") -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.torch_dtype, _ = check_store_dtype(dtype)
        self.feature_dim, self.topk, self.part_bytes = feature_dim, topk, part_bytes
        self.schema = feature_schema(topk)
        self.prefix = prefix
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        self._path: Path | None = None
        self._parts, self._bytes, self.rows, self.tokens = 0, 0, 0, 0

    def _open(self) -> None:
        self._path = self.dir / f"{self.prefix}-{self._parts:05d}.arrow"
        self._writer = pa.ipc.new_file(str(self._path) + ".partial", self.schema)
        self._parts += 1
        self._bytes = 0

    def add(self, rows: list[int], hidden: list[torch.Tensor], argmax: list[torch.Tensor],
            topk_ids: list[torch.Tensor] | None = None,
            topk_logits: list[torch.Tensor] | None = None) -> None:
        """One record batch: per row, hidden [L, F], argmax [L] (and top-k [L, k])."""
        if self._writer is not None and self._bytes >= self.part_bytes:
            self.commit()
        if self._writer is None:
            self._open()

        def raw(t: torch.Tensor) -> bytes:
            t = t.detach().cpu().contiguous()
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)
            return t.numpy().tobytes()

        cols: dict[str, list[Any]] = {
            "row": rows, "length": [int(h.shape[0]) for h in hidden],
            "hidden": [raw(h.to(self.torch_dtype)) for h in hidden],
            "argmax": [raw(a.to(torch.int32)) for a in argmax],
        }
        if self.topk:
            assert topk_ids is not None and topk_logits is not None
            cols["topk_ids"] = [raw(t.to(torch.int32)) for t in topk_ids]
            cols["topk_logits"] = [raw(t.float()) for t in topk_logits]
        batch = pa.record_batch([pa.array(cols[f.name], f.type) for f in self.schema],
                                schema=self.schema)
        assert self._writer is not None
        self._writer.write_batch(batch)
        self._bytes += batch.nbytes
        self.rows += len(rows)
        self.tokens += sum(cols["length"])

    def commit(self) -> None:
        """Close the open part and give it its final name (no-op when none is open)."""
        if self._writer is not None:
            assert self._path is not None
            self._writer.close()
            Path(str(self._path) + ".partial").replace(self._path)
            self._writer = None

    def close(self) -> None:
        self.commit()


def write_manifest(out_dir: Path, fingerprint: dict[str, Any], stats: dict[str, Any]) -> None:
    body = {"format": FORMAT_VERSION, "fingerprint": fingerprint, **stats}
    (Path(out_dir) / MANIFEST).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")


def read_manifest(path: Path) -> dict[str, Any] | None:
    f = Path(path) / MANIFEST
    if not f.is_file():
        return None
    return json.loads(f.read_text())


def fingerprint_diff(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Keys whose values differ between two fingerprints (what made a cache stale)."""
    return sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))


class FeatureStore:
    """Memory-mapped read access to a feature cache directory, by raw data row."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        manifest = read_manifest(self.path)
        if manifest is None:
            raise FeatureCacheError(f"{self.path}: no {MANIFEST} (not a finished feature cache)")
        if manifest.get("format") != FORMAT_VERSION:
            raise FeatureCacheError(
                f"{self.path}: feature cache format {manifest.get('format')} != "
                f"{FORMAT_VERSION}; delete the directory to rebuild it")
        self.manifest = manifest
        fp = manifest["fingerprint"]
        self.feature_dim = int(manifest["feature_dim"])
        self.torch_dtype, self.np_dtype = check_store_dtype(fp["dtype"])
        self.topk = int(fp.get("topk", 0))
        self._cols: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []
        self._where: dict[int, tuple[int, int]] = {}
        self._lengths: dict[int, int] = {}
        self._maps = []
        for f in sorted(self.path.glob("part-*.arrow")):
            mm = pa.memory_map(str(f), "r")
            self._maps.append(mm)
            reader = pa.ipc.open_file(mm)
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                cols = {name: _binary_views(batch.column(name))
                        for name in batch.schema.names if name not in ("row", "length")}
                rows = batch.column("row").to_numpy()
                lengths = batch.column("length").to_numpy()
                for j, (r, n) in enumerate(zip(rows.tolist(), lengths.tolist())):
                    self._where[r] = (len(self._cols), j)
                    self._lengths[r] = n
                self._cols.append(cols)
        if len(self._where) != int(manifest["rows"]):
            raise FeatureCacheError(
                f"{self.path}: {len(self._where)} rows found, the manifest says "
                f"{manifest['rows']}; the cache is incomplete: delete it to rebuild")

    def __len__(self) -> int:
        return len(self._where)

    def _bytes(self, col: str, row: int) -> np.ndarray:
        try:
            b, j = self._where[row]
        except KeyError:
            raise FeatureCacheError(
                f"{self.path}: no cached features for data row {row}; the cache was made from "
                "other data: delete it to rebuild") from None
        offsets, values = self._cols[b][col]
        return values[offsets[j]: offsets[j + 1]]

    def uncovered(self, rows, lengths) -> list[int]:
        """The data rows among ``rows`` (with ``lengths`` tokens each) the cache cannot serve."""
        return [int(r) for r, n in zip(rows, lengths) if self._lengths.get(int(r), -1) < int(n)]

    def hidden(self, row: int, length: int) -> np.ndarray:
        """[length, F] stored features of ``row`` (bf16 as uint16 bits, or fp32)."""
        have = self._lengths.get(row, -1)
        if have < length:
            raise FeatureCacheError(
                f"{self.path}: row {row} has {have} cached positions, the data has {length}: "
                "the cache was made with another data.max_length; delete it to rebuild")
        return self._bytes("hidden", row).view(self.np_dtype).reshape(-1, self.feature_dim)[:length]

    def argmax(self, row: int, length: int) -> np.ndarray:
        return self._bytes("argmax", row).view(np.int32)[:length]

    def topk_logits(self, row: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """([length, k] int32 ids, [length, k] fp32 logits): the target's top-k at each
        position (``self.topk`` = k, 0 when the cache holds none)."""
        ids = self._bytes("topk_ids", row).view(np.int32).reshape(-1, self.topk)[:length]
        vals = self._bytes("topk_logits", row).view(np.float32).reshape(-1, self.topk)[:length]
        return ids, vals

    def __getstate__(self) -> dict[str, Any]:  # loader workers re-open the memory maps
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])


def _binary_views(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values as uint8) of a binary column, both zero-copy."""
    bufs = arr.buffers()
    off_type = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(bufs[1], dtype=off_type)[arr.offset: arr.offset + len(arr) + 1]
    values = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    return offsets, values


def to_tensor(hidden: np.ndarray) -> torch.Tensor:
    """Stored features -> float32 tensor (bf16 bits are widened exactly)."""
    if hidden.dtype == np.uint16:
        return torch.from_numpy(hidden.astype(np.int16)).view(torch.bfloat16).float()
    return torch.from_numpy(np.array(hidden, dtype=np.float32))
