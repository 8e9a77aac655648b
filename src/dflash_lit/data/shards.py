"""Regenerated-completion shards: write, load (memory-mapped Arrow), validate, filter.

A shard row has ``id`` (str), ``source`` (str), ``input_ids`` (list of int) and ``loss_mask``
(list of 0/1, same length, 1 on completion tokens). ``load_shards`` accepts a directory of
``*.parquet`` and/or ``*.arrow`` files (Arrow streams as ``datasets`` writes them), a single
such file, or a ``save_to_disk`` directory. Everything is checked with vectorised Arrow/NumPy
passes before any model loads, and each problem raises a one-line :class:`ShardError` naming
the file and row id. Rows are never rewritten: truncation is applied lazily when a row is read.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dflash_lit.atomic import atomic_write
from dflash_lit.errors import UserError

log = logging.getLogger(__name__)

# The columns training reads, as written; regeneration adds its own after them.
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
    ]
)
REQUIRED_COLUMNS = tuple(SCHEMA.names)
SHARD_PATTERNS = ("*.parquet", "*.arrow")
OVERLENGTH_MODES = ("truncate", "drop")


class ShardError(UserError):
    """Bad shard data or path (one-line message: what, where, what to do)."""


@dataclass
class FilterReport:
    """Rows seen and dropped per reason (each dropped row is counted under its first reason)."""

    total: int = 0  # rows in the shards
    kept: int = 0  # rows in the returned dataset
    all_zero_mask: int = 0  # dropped: no completion token at all
    overlength_dropped: int = 0  # dropped: longer than max_length with overlength='drop'
    short_completion: int = (
        0  # dropped: < min_completion_tokens completion tokens (after truncation)
    )
    truncated: int = 0  # kept but cut to max_length (overlength='truncate')

    def as_dict(self) -> dict[str, int]:
        """Counts as a plain dict (for logging / hparams)."""
        return asdict(self)

    def summary(self) -> str:
        """One log line."""
        return (
            f"kept {self.kept}/{self.total} rows; dropped: "
            f"all-zero loss_mask {self.all_zero_mask}, "
            f"over max_length {self.overlength_dropped}, short completion {self.short_completion}; "
            f"truncated {self.truncated}"
        )


# --------------------------------------------------------------------------- writing

def write_shards(
    rows: Iterable[Mapping[str, Any]],
    out_dir: str | os.PathLike,
    rows_per_shard: int = 1000,
    *,
    prefix: str = "shard",
    start: int = 0,
) -> list[Path]:
    """Write ``rows`` (dicts with id, source, input_ids, loss_mask) as Parquet shards.

    Files are ``{prefix}-{k:05d}.parquet`` for k = start, start+1, ...; each is written to a
    temporary name and renamed, so a killed writer never leaves a half shard that loads.
    Returns the written paths.
    """
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    buf: list[Mapping[str, Any]] = []

    def flush() -> None:
        path = out / f"{prefix}-{start + len(paths):05d}.parquet"
        cols = {name: [r[name] for r in buf] for name in REQUIRED_COLUMNS}
        cols["id"] = [str(x) for x in cols["id"]]
        cols["source"] = [str(x) for x in cols["source"]]
        table = pa.table(cols, schema=SCHEMA)
        atomic_write(path, lambda f: pq.write_table(table, f), what="shard")
        paths.append(path)
        buf.clear()

    for row in rows:
        missing = [c for c in REQUIRED_COLUMNS if c not in row]
        if missing:
            raise ShardError(f"write_shards: row {row.get('id', '?')!r} lacks {', '.join(missing)}")
        buf.append(row)
        if len(buf) == rows_per_shard:
            flush()
    if buf:
        flush()
    return paths


# --------------------------------------------------------------------------- finding / opening
def find_shards(path: str | os.PathLike, what: str = "data.path") -> list[Path]:
    """Shard files under ``path`` in load order (a save_to_disk dir lists its own files).

    ``path`` may also be a glob over shard files (``train/shard-*[036].parquet``): a subset of
    a dataset's shards, named in the config and hence reproducible.
    """
    if any(c in str(path) for c in "*?["):
        found = sorted(Path(f) for f in glob.glob(str(path))
                       if Path(f).is_file() and Path(f).suffix in (".parquet", ".arrow"))
        if not found:
            raise ShardError(f"{what}: the pattern '{path}' matches no .parquet or .arrow file")
        return found
    p = Path(path)
    if not p.exists():
        raise ShardError(f"{what}: '{p}' does not exist; point it at a directory of shards")
    if p.is_file():
        if p.suffix not in (".parquet", ".arrow"):
            raise ShardError(f"{what}: '{p}' is not a .parquet or .arrow file")
        return [p]
    state = p / "state.json"
    if state.is_file():  # datasets.save_to_disk layout
        files = json.loads(state.read_text()).get("_data_files", [])
        found = [p / f["filename"] for f in files]
        if found:
            return found
    found = sorted(f for pat in SHARD_PATTERNS for f in p.glob(pat) if f.is_file())
    if not found:
        raise ShardError(
            f"{what}: no shards in '{p}': searched {', '.join(SHARD_PATTERNS)} and a "
            "save_to_disk dir (state.json)"
        )
    return found


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def _check_schema(file: Path, schema: pa.Schema) -> None:
    names = schema.names
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise ShardError(
            f"{file}: missing column '{missing[0]}' (has: {', '.join(names)}); every shard needs "
            f"{', '.join(REQUIRED_COLUMNS)}"
        )
    for col in ("input_ids", "loss_mask"):
        t = schema.field(col).type
        ok = (pa.types.is_list(t) or pa.types.is_large_list(t)) and (
            pa.types.is_integer(t.value_type) or pa.types.is_boolean(t.value_type)
        )
        if not ok:
            raise ShardError(f"{file}: column '{col}' must be a list of integers, got {t}")


def _open_shard(file: Path, cache_dir: str | None) -> Any:
    """One shard as a memory-mapped ``datasets.Dataset`` (Parquet is converted once, cached)."""
    import datasets

    if file.suffix == ".parquet":
        try:
            schema = pq.read_schema(file)
        except Exception as e:
            raise ShardError(f"{file}: not a readable Parquet file ({e})") from e
        _check_schema(file, schema)
        with _quiet_datasets():
            return datasets.Dataset.from_parquet(str(file), cache_dir=cache_dir)
    try:
        ds = datasets.Dataset.from_file(str(file))
    except Exception as e:
        raise ShardError(f"{file}: not a readable Arrow stream as datasets writes it ({e})") from e
    _check_schema(file, ds.data.table.schema)
    return ds


# --------------------------------------------------------------------------- validation
def _list_column(table: pa.Table, name: str, file: Path, ids: pa.ChunkedArray):
    """(offsets[n+1] int64 rebased to 0, values ndarray) of a list column, nulls rejected."""
    col = table.column(name)
    offs, vals, base, row0 = [], [], 0, 0
    for chunk in col.chunks:
        if chunk.null_count:
            row = row0 + int(np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False))[0])
            raise ShardError(f"{file}: row id {ids[row].as_py()!r} (row {row}): '{name}' is null")
        row0 += len(chunk)
        o = chunk.offsets.to_numpy().astype(np.int64)
        v = chunk.values.slice(int(o[0]), int(o[-1] - o[0])).to_numpy(zero_copy_only=False)
        offs.append(o[1:] - o[0] + base if offs else o - o[0])
        base += int(o[-1] - o[0])
        vals.append(v)
    if not offs:
        return np.zeros(1, np.int64), np.zeros(0, np.int64)
    return np.concatenate(offs), (np.concatenate(vals) if len(vals) > 1 else vals[0])


def _row_of(offsets: np.ndarray, pos: int) -> int:
    return int(np.searchsorted(offsets, pos, side="right") - 1)


def _validate_and_count(
    file: Path, table: pa.Table, vocab_size: int | None, max_length: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check one shard; return per-row length, completion tokens, and those in max_length."""
    ids = table.column("id")
    ioff, ivals = _list_column(table, "input_ids", file, ids)
    moff, mvals = _list_column(table, "loss_mask", file, ids)
    n_ids, n_mask = np.diff(ioff), np.diff(moff)
    bad = np.flatnonzero(n_ids != n_mask)
    if len(bad):
        r = int(bad[0])
        raise ShardError(
            f"{file}: row id {ids[r].as_py()!r} (row {r}): loss_mask has {n_mask[r]} entries but "
            f"input_ids has {n_ids[r]} ({len(bad)} such rows in this file); regenerate the shard"
        )
    if len(mvals):
        badpos = np.flatnonzero((mvals != 0) & (mvals != 1))
        if len(badpos):
            r = _row_of(moff, int(badpos[0]))
            raise ShardError(
                f"{file}: row id {ids[r].as_py()!r} (row {r}): loss_mask value "
                f"{mvals[badpos[0]]} is not 0/1"
            )
    if len(ivals):
        lo = ivals < 0
        hi = ivals >= vocab_size if vocab_size is not None else np.zeros_like(lo)
        badpos = np.flatnonzero(lo | hi)
        if len(badpos):
            pos = int(badpos[0])
            r = _row_of(ioff, pos)
            nrows = len(np.unique(np.searchsorted(ioff, badpos, side="right")))
            tok = int(ivals[pos])
            what = "is negative" if tok < 0 else f">= vocab_size {vocab_size}"
            raise ShardError(
                f"{file}: row id {ids[r].as_py()!r} (row {r}): token id {tok} {what} "
                f"({nrows} such rows in this file); were the shards made with another tokenizer?"
            )
    cs = np.zeros(len(mvals) + 1, dtype=np.int64)
    np.cumsum(mvals, out=cs[1:])
    start = moff[:-1]
    completion = cs[moff[1:]] - cs[start]
    if max_length is None:
        return n_ids, completion, completion
    kept_len = np.minimum(n_ids, max_length)
    return n_ids, completion, cs[start + kept_len] - cs[start]


# --------------------------------------------------------------------------- dataset
class ShardDataset(torch.utils.data.Dataset):
    """Kept rows of some shards; item ``i`` is ``{input_ids, loss_mask, index=i}`` (NumPy int64).

    Holds the memory-mapped shards plus, per kept row, its global raw row number and its
    effective (possibly truncated) length. ``subset`` makes views that share the shards.
    """

    def __init__(
        self, parts: Sequence[Any], files: Sequence[Path], rows: np.ndarray, lengths: np.ndarray
    ) -> None:
        self._parts = list(parts)
        self.files = [Path(f) for f in files]
        sizes = [len(p) for p in self._parts]
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self._ids: list[str] | None = None
        # cached target features (data.features=cache): items gain target_hidden/_argmax
        self.features: Any = None

    def __len__(self) -> int:
        return len(self.rows)

    def subset(self, positions: np.ndarray) -> ShardDataset:
        """A view holding rows ``positions`` of this dataset (indices renumbered from 0)."""
        pos = np.asarray(positions, dtype=np.int64)
        out = ShardDataset(self._parts, self.files, self.rows[pos], self.lengths[pos])
        out.features = self.features
        if self._ids is not None:
            out._ids = [self._ids[i] for i in pos.tolist()]
        return out

    def _locate(self, raw: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._starts, raw, side="right") - 1

    @property
    def ids(self) -> list[str]:
        """Row ids (``str``) of the kept rows, in dataset order."""
        if self._ids is None:
            part = self._locate(self.rows)
            out: list[str] = [""] * len(self.rows)
            for p in np.unique(part).tolist():
                sel = np.flatnonzero(part == p)
                col = self._parts[p].data.table.column("id")
                vals = col.take(pa.array(self.rows[sel] - self._starts[p])).to_pylist()
                for k, v in zip(sel.tolist(), vals):
                    out[k] = str(v)
            self._ids = out
        return self._ids

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Batched read (torch's fetcher calls this): one Arrow ``take`` per shard touched,
        plus each row's target features when a cache (or feature servers) is attached."""
        out = self._read(indices)
        if self.features is not None:
            raw = self.rows[np.asarray(indices, dtype=np.int64)].tolist()
            served = hasattr(self.features, "ensure")  # from servers: fetched unless fetched
            if served:  # ahead, and dropped once read
                self.features.ensure(raw, [row["input_ids"] for row in out])
            for r, row in zip(raw, out):
                n = len(row["input_ids"])
                row["target_hidden"] = self.features.hidden(r, n)
                row["target_argmax"] = self.features.argmax(r, n)
                if self.features.topk:
                    row["target_topk"] = self.features.topk_logits(r, n)
            if served:
                self.features.release(raw)
        return out

    def token_ids(self, indices: Sequence[int]) -> list[np.ndarray]:
        """The (effective-length) token ids of rows ``indices``."""
        return [row["input_ids"] for row in self._read(indices)]

    def _read(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """``{input_ids, loss_mask, index}`` of rows ``indices`` (no features)."""
        idx = np.asarray(indices, dtype=np.int64)
        raw = self.rows[idx]
        part = self._locate(raw)
        out: list[dict[str, Any]] = [{} for _ in range(len(idx))]
        for p in np.unique(part).tolist():
            sel = np.flatnonzero(part == p)
            table = self._parts[p].data.table
            take = pa.array(raw[sel] - self._starts[p])
            cols = {}
            for name in ("input_ids", "loss_mask"):
                arr = table.column(name).take(take)
                arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
                o = arr.offsets.to_numpy().astype(np.int64)
                v = arr.values.to_numpy(zero_copy_only=False).astype(np.int64)
                cols[name] = (o, v)
            for j, k in enumerate(sel.tolist()):
                n = int(self.lengths[idx[k]])
                row = {}
                for name, (o, v) in cols.items():
                    row[name] = v[o[j] : o[j] + n]
                row["index"] = int(idx[k])
                out[k] = row
        return out


# --------------------------------------------------------------------------- loading
def load_shards(
    path: str | os.PathLike,
    *,
    max_length: int | None = None,
    overlength: str = "truncate",
    min_completion_tokens: int = 32,
    vocab_size: int | None = None,
    cache_dir: str | None = None,
    what: str = "data.path",
) -> tuple[ShardDataset, FilterReport]:
    """Open, validate and filter the shards at ``path``.

    Args:
        path: directory of ``*.parquet`` / ``*.arrow`` shards, one such file, or a
            ``save_to_disk`` directory.
        max_length: longest kept sequence; longer rows are truncated or dropped.
        overlength: ``'truncate'`` (keep the first ``max_length`` tokens) or ``'drop'``.
        min_completion_tokens: rows with fewer completion tokens (``loss_mask`` ones, counted
            after truncation) are dropped; rows with an all-zero mask are always dropped.
        vocab_size: if given, every token id must be in ``[0, vocab_size)``.
        cache_dir: where ``datasets`` caches Parquet converted to Arrow (default: HF cache).
        what: config key named in error messages.

    Returns:
        The kept rows and a :class:`FilterReport` (also logged at INFO).
    """
    if overlength not in OVERLENGTH_MODES:
        raise ShardError(f"overlength must be one of {OVERLENGTH_MODES}, got {overlength!r}")
    if max_length is not None and max_length < 1:
        raise ShardError(f"max_length must be >= 1, got {max_length}")
    files = find_shards(path, what)
    parts = [_open_shard(f, cache_dir) for f in files]
    report = FilterReport()
    rows, lengths = [], []
    start = 0
    for f, ds in zip(files, parts):
        n_ids, comp, comp_kept = _validate_and_count(f, ds.data.table, vocab_size, max_length)
        over = n_ids > max_length if max_length is not None else np.zeros(len(n_ids), bool)
        zero = comp == 0
        drop_over = over & ~zero if overlength == "drop" else np.zeros_like(over)
        short = ~zero & ~drop_over & (comp_kept < max(1, min_completion_tokens))
        keep = ~(zero | drop_over | short)
        report.total += len(n_ids)
        report.all_zero_mask += int(zero.sum())
        report.overlength_dropped += int(drop_over.sum())
        report.short_completion += int(short.sum())
        report.truncated += int((over & keep).sum())
        local = np.flatnonzero(keep)
        rows.append(local + start)
        eff = np.minimum(n_ids, max_length) if max_length is not None else n_ids
        lengths.append(eff[local])
        start += len(n_ids)
    report.kept = int(sum(len(r) for r in rows))
    dataset = ShardDataset(parts, files, np.concatenate(rows), np.concatenate(lengths))
    log.info("shards %s: %s", path, report.summary())
    return dataset, report
