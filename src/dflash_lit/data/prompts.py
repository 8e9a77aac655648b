"""Prompt sources for regeneration: load JSONL / Parquet / HF-dataset prompts and mix them.

Only prompts are read. For chat-format sources (``field: messages``) the *last assistant
message is dropped*: the original response is never used, the target writes its own.

Every record gets a stable id ``<source name>:<key>``: key = the record's ``id_field`` value
when the source names one, else the 1-based line number (JSONL) or 0-based row index (Parquet /
HF datasets). A rerun thus selects the same ids and resume skips the ones already generated.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_lit.errors import UserError

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet", "hf_dataset")
# How many malformed records per source are logged one by one before only counting.
_MAX_REPORTED = 10


class PromptError(UserError):
    """Bad prompt input: names the file (and line / row) and what to do."""


@dataclass(frozen=True)
class PromptSource:
    """One entry of the ``sources`` config list."""

    path: str
    format: str = "jsonl"
    field: str = "prompt"
    weight: float = 1.0
    name: str = ""
    split: str | None = None  # hf_dataset only: split of a DatasetDict
    id_field: str | None = None  # column holding a record id (unique per source); None = position

    @property
    def is_chat(self) -> bool:
        """Chat-format source: the field holds a list of {role, content} messages."""
        return self.field == "messages"


@dataclass
class Prompt:
    """A prompt ready to be rendered: plain ``text`` or chat ``messages`` (never both)."""

    id: str
    source: str
    origin: str  # "file:line" or "file row i", for error messages
    text: str | None = None
    messages: list[dict[str, str]] | None = None


@dataclass
class SourceStats:
    """Per-source load counts (malformed and empty records are skipped, never fatal unless strict)."""

    records: int = 0
    loaded: int = 0
    malformed: int = 0
    empty: int = 0
    blank_lines: int = 0
    dropped_assistant: int = 0
    issues: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "loaded": self.loaded,
            "malformed": self.malformed,
            "empty": self.empty,
            "dropped_assistant": self.dropped_assistant,
            "issues": dict(self.issues),
        }


def parse_sources(raw: Sequence[Any]) -> list[PromptSource]:
    """Validate the ``sources`` config list (dicts) into ``PromptSource`` objects.

    ``format`` may be omitted: ``.jsonl`` → jsonl, ``.parquet`` → parquet, a directory →
    hf_dataset. ``name`` defaults to the file stem and must be unique (it prefixes ids).
    """
    if raw is None or len(raw) == 0:
        raise PromptError("sources: empty; give at least one {path, field} entry")
    out: list[PromptSource] = []
    allowed = {"path", "format", "field", "weight", "name", "split", "id_field"}
    for i, entry in enumerate(raw):
        where = f"sources[{i}]"
        if not hasattr(entry, "get"):
            raise PromptError(f"{where}: expected a mapping like {{path: x.jsonl, field: prompt}}")
        unknown = set(entry.keys()) - allowed
        if unknown:
            raise PromptError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        path = entry.get("path")
        if not path:
            raise PromptError(f"{where}.path: missing")
        fmt = entry.get("format") or _infer_format(str(path))
        if fmt not in FORMATS:
            raise PromptError(f"{where}.format: {fmt!r} is not one of {FORMATS}")
        weight = float(entry.get("weight", 1.0) if entry.get("weight") is not None else 1.0)
        if not weight >= 0:
            raise PromptError(f"{where}.weight: must be >= 0, got {weight}")
        name = str(entry.get("name") or Path(str(path)).name.split(".")[0])
        src = PromptSource(
            path=str(path),
            format=fmt,
            field=str(entry.get("field") or "prompt"),
            weight=weight,
            name=name,
            split=entry.get("split"),
            id_field=entry.get("id_field"),
        )
        if any(s.name == name for s in out):
            raise PromptError(f"{where}.name: duplicate source name {name!r}; set a unique `name`")
        out.append(src)
    return out


def _infer_format(path: str) -> str:
    p = Path(path)
    if p.is_dir():
        return "hf_dataset"
    if p.suffix == ".parquet":
        return "parquet"
    return "jsonl"


class _Issues:
    """Collects malformed-record reports: raise when strict, else log the first few and count."""

    def __init__(self, source: PromptSource, stats: SourceStats, strict: bool) -> None:
        self.source, self.stats, self.strict = source, stats, strict

    def malformed(self, kind: str, msg: str) -> None:
        if self.strict:
            raise PromptError(f"{msg} (strict=true; set strict=false to skip and count such records)")
        self.stats.malformed += 1
        self.stats.issues[kind] = self.stats.issues.get(kind, 0) + 1
        if self.stats.malformed <= _MAX_REPORTED:
            log.warning("skipping malformed prompt: %s", msg)
        elif self.stats.malformed == _MAX_REPORTED + 1:
            log.warning("source %r: more malformed records, counting only", self.source.name)


def load_source(source: PromptSource, strict: bool = False) -> tuple[list[Prompt], SourceStats]:
    """Load every valid prompt of one source, in file order.

    Raises ``PromptError`` for a missing file or column; malformed records (not UTF-8, bad
    JSON, missing field, wrong type) raise only when ``strict``, else are skipped and counted.
    Empty prompts are skipped and counted.
    """
    path = Path(source.path)
    if not path.exists():
        raise PromptError(f"prompt source {source.name!r}: file not found: {path}")
    stats = SourceStats()
    issues = _Issues(source, stats, strict)
    if source.format == "jsonl":
        if path.is_dir():
            raise PromptError(f"prompt source {source.name!r}: {path} is a directory, not a .jsonl file")
        values = _iter_jsonl(path, source, stats, issues)
    else:
        values = _iter_columnar(source, path, issues)
    prompts: list[Prompt] = []
    seen: dict[str, str] = {}
    for key, origin, value in values:
        stats.records += 1
        pid = f"{source.name}:{key}"
        if pid in seen:
            issues.malformed("duplicate_id", f"{origin}: duplicate id {pid!r} (first at {seen[pid]})")
            continue
        prompt = _make_prompt(source, pid, origin, value, stats, issues)
        if prompt is not None:
            seen[pid] = origin
            prompts.append(prompt)
    stats.loaded = len(prompts)
    if stats.records > 0 and not prompts and stats.issues.get("missing_field") == stats.records:
        raise PromptError(
            f"prompt source {source.name!r}: field {source.field!r} is missing in every record of "
            f"{path}; set sources[].field to the prompt column"
        )
    return prompts, stats


def _iter_jsonl(path: Path, source: PromptSource, stats: SourceStats, issues: _Issues):
    """Yield (id key, origin, field value) per JSONL line; report bad lines with file:line."""
    fld, id_field = source.field, source.id_field
    offset = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            line_offset, offset = offset, offset + len(raw)
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw, line_offset = raw[3:], 3
            origin = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                issues.malformed(
                    "not_utf8",
                    f"{origin}: not valid UTF-8 at byte offset {line_offset + e.start} of the file "
                    f"(byte 0x{raw[e.start]:02x}); re-encode the file as UTF-8",
                )
                stats.records += 1
                continue
            if not text.strip():
                stats.blank_lines += 1
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                issues.malformed("bad_json", f"{origin}: malformed JSON: {e.msg} at column {e.colno}")
                stats.records += 1
                continue
            if not isinstance(obj, dict):
                issues.malformed(
                    "bad_json", f"{origin}: expected a JSON object per line, got {type(obj).__name__}"
                )
                stats.records += 1
                continue
            if fld not in obj:
                issues.malformed(
                    "missing_field",
                    f"{origin}: missing field {fld!r} (keys present: {sorted(obj)[:10]})",
                )
                stats.records += 1
                continue
            if id_field is None:
                yield lineno, origin, obj[fld]
                continue
            rid = obj.get(id_field)
            if not isinstance(rid, str | int) or isinstance(rid, bool) or rid == "":
                issues.malformed(
                    "missing_id", f"{origin}: id field {id_field!r} missing or not a str/int"
                )
                stats.records += 1
                continue
            yield rid, origin, obj[fld]


def _iter_columnar(source: PromptSource, path: Path, issues: _Issues):
    """Yield (id key, origin, value) for a Parquet file/dir or a ``save_to_disk`` dataset."""
    wanted = [source.field] + ([source.id_field] if source.id_field else [])
    if source.format == "parquet":
        columns = _read_parquet_columns(source, path, wanted)
    else:
        columns = _read_hf_columns(source, path, wanted)
    values = columns[0]
    ids = columns[1] if source.id_field else range(len(values))
    for i, (value, rid) in enumerate(zip(values, ids)):
        origin = f"{path} row {i}"
        if value is None:
            issues.stats.records += 1
            issues.malformed("missing_field", f"{origin}: field {source.field!r} is null")
            continue
        if rid is None or rid == "":
            issues.stats.records += 1
            issues.malformed("missing_id", f"{origin}: id field {source.id_field!r} is null")
            continue
        yield rid, origin, value


def _read_parquet_columns(source: PromptSource, path: Path, wanted: list[str]) -> list[list[Any]]:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names if path.is_file() else None
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise PromptError(f"prompt source {source.name!r}: cannot read Parquet {path}: {e}") from e
    for col in wanted:
        if names is not None and col not in names:
            raise PromptError(
                f"prompt source {source.name!r}: column {col!r} not in {path}; columns: {names}"
            )
    try:
        table = pq.read_table(path, columns=wanted)
    except Exception as e:
        raise PromptError(f"prompt source {source.name!r}: cannot read Parquet {path}: {e}") from e
    return [table.column(c).to_pylist() for c in wanted]


def _read_hf_columns(source: PromptSource, path: Path, wanted: list[str]) -> list[list[Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise PromptError(
            f"prompt source {source.name!r}: cannot load_from_disk({path}): {e}; hf_dataset expects "
            "a directory written by Dataset.save_to_disk"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds.keys())
        if source.split is None and len(splits) == 1:
            ds = ds[splits[0]]
        elif source.split in ds:
            ds = ds[source.split]
        else:
            raise PromptError(
                f"prompt source {source.name!r}: {path} has splits {splits}; set sources[].split"
            )
    for col in wanted:
        if col not in ds.column_names:
            raise PromptError(
                f"prompt source {source.name!r}: column {col!r} not in {path}; "
                f"columns: {ds.column_names}"
            )
    return [ds[c] for c in wanted]


def _make_prompt(
    source: PromptSource, pid: str, origin: str, value: Any, stats: SourceStats, issues: _Issues
) -> Prompt | None:
    if source.is_chat:
        messages = _validate_messages(value, origin, issues)
        if messages is None:
            return None
        if messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]  # the original response: never used
            stats.dropped_assistant += 1
        if not any(m["role"] != "system" and m["content"].strip() for m in messages):
            stats.empty += 1
            return None
        return Prompt(id=pid, source=source.name, origin=origin, messages=messages)
    if not isinstance(value, str):
        issues.malformed(
            "bad_type",
            f"{origin}: field {source.field!r} must be a string, got {type(value).__name__} "
            "(use field: messages for chat-format lists)",
        )
        return None
    if not value.strip():
        stats.empty += 1
        return None
    return Prompt(id=pid, source=source.name, origin=origin, text=value)


def _validate_messages(value: Any, origin: str, issues: _Issues) -> list[dict[str, str]] | None:
    if not isinstance(value, list):
        issues.malformed(
            "bad_type", f"{origin}: field 'messages' must be a list, got {type(value).__name__}"
        )
        return None
    out = []
    for j, m in enumerate(value):
        ok = isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        if not ok:
            issues.malformed(
                "bad_type",
                f"{origin}: messages[{j}] must be {{role: str, content: str}}, got {str(m)[:80]}",
            )
            return None
        out.append({"role": m["role"], "content": m["content"]})
    return out


@dataclass
class MixStats:
    """What the mixer took from each source."""

    selected: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    requested: int | None = None


def allocate(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` into integer quotas proportional to ``weights`` (largest remainder).

    Ties go to the earlier source, so the split is deterministic.
    """
    wsum = float(sum(weights))
    if total <= 0 or wsum <= 0:
        return [0] * len(weights)
    exact = [total * w / wsum for w in weights]
    quotas = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in order[: total - sum(quotas)]:
        quotas[i] += 1
    return quotas


def mix(
    pools: Sequence[Sequence[Prompt]],
    sources: Sequence[PromptSource],
    num_prompts: int | None,
    seed: int,
    accept: Callable[[Prompt], bool] | None = None,
) -> tuple[list[Prompt], MixStats]:
    """Draw ``num_prompts`` prompts from the pools by source weight, deterministically from seed.

    Each pool is walked in a seeded random order; ``accept`` (e.g. the prompt-length filter)
    may reject a prompt, which is counted and replaced by the next one. A pool that runs out
    has its shortfall redistributed over the others by weight. ``num_prompts=None`` takes
    every accepted prompt of every source with weight > 0. The result is shuffled (seeded).
    """
    accept = accept or (lambda p: True)
    stats = MixStats(requested=num_prompts)
    orders = []
    for pool, src in zip(pools, sources):
        order = list(range(len(pool)))
        random.Random(f"{seed}:{src.name}").shuffle(order)
        orders.append(order)
    cursors = [0] * len(pools)
    taken: list[list[Prompt]] = [[] for _ in pools]
    rejected = [0] * len(pools)

    def take(i: int, k: int | None) -> None:
        """Take up to k accepted prompts from pool i (all if k is None)."""
        got = 0
        while cursors[i] < len(orders[i]) and (k is None or got < k):
            p = pools[i][orders[i][cursors[i]]]
            cursors[i] += 1
            if accept(p):
                taken[i].append(p)
                got += 1
            else:
                rejected[i] += 1

    active = [i for i, s in enumerate(sources) if s.weight > 0 and len(pools[i]) > 0]
    if num_prompts is None:
        for i in active:
            take(i, None)
    else:
        while active:
            remaining = num_prompts - sum(len(t) for t in taken)
            if remaining <= 0:
                break
            quotas = allocate(remaining, [sources[i].weight for i in active])
            for i, q in zip(active, quotas):
                take(i, q)
            active = [i for i in active if cursors[i] < len(orders[i])]
    out = [p for t in taken for p in t]
    random.Random(seed).shuffle(out)
    for i, src in enumerate(sources):
        stats.selected[src.name] = len(taken[i])
        stats.rejected[src.name] = rejected[i]
    return out, stats
