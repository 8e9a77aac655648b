"""Tokenizer ↔ target agreement.

Token ids are only meaningful for the tokenizer that produced them. Two mistakes load
silently and train or evaluate garbage: a tokenizer larger than the target's embedding (ids
index past it, or crash deep inside a forward), and shards regenerated with one tokenizer fed
to a target with another (every id means a different token). Both are checked up front.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from dflash_lit.data.shards import ShardError, find_shards
from dflash_lit.errors import UserError

META_KEY = b"dflash_lit.regenerate"  # parquet schema metadata of regenerated shards


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """16 hex digits over the tokenizer's (id, token) table: equal iff ids mean the same tokens."""
    h = hashlib.sha256()
    for tok, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{i}\t{tok}\n".encode())
    return h.hexdigest()[:16]


def check_tokenizer_fits(tokenizer: Any, vocab_size: int, where: str, fix: str) -> None:
    """Raise ValueError when the tokenizer can emit ids ≥ the target's ``vocab_size``.

    A smaller tokenizer is fine (embeddings are often padded past the tokenizer, e.g. Qwen3).
    """
    n = len(tokenizer)
    if n > vocab_size:
        raise UserError(
            f"{where}: the tokenizer has {n} tokens but the target's embedding has "
            f"vocab_size={vocab_size} rows (ids {vocab_size}..{n - 1} index past it): this "
            f"tokenizer does not belong to this target; {fix}"
        )


def regenerated_with(path: str | Path) -> tuple[Path, str] | None:
    """(shard file, tokenizer fingerprint) recorded by regenerate.py in the first parquet shard
    under ``path``; None for data without that record (hand-made or older shards)."""
    try:
        files = [f for f in find_shards(path) if f.suffix == ".parquet"]
    except ShardError:
        return None
    for f in files[:1]:
        meta = (pq.read_schema(f).metadata or {}).get(META_KEY)
        tok = json.loads(meta).get("tokenizer") if meta else None
        if tok:
            return f, str(tok)
    return None


def check_data_tokenizer(data_paths: dict[str, Any], target_path: str | None) -> None:
    """Refuse shards regenerated with another tokenizer than the one at ``target_path``.

    ``data_paths`` maps config keys (``data.path``, ``data.val_path``) to paths. Nothing to check
    without a target directory (random test targets) or without a recorded fingerprint.
    """
    if not target_path:
        return
    recorded = {k: r for k, v in data_paths.items() if v and (r := regenerated_with(v))}
    if not recorded:
        return
    from transformers import AutoTokenizer

    have = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(target_path)))
    for key, (file, fp) in recorded.items():
        if fp != have:
            raise UserError(
                f"{key}: {file} was regenerated with another tokenizer (fingerprint {fp}) than "
                f"the target's at target.path={target_path} ({have}), so its token ids mean "
                "other tokens; regenerate the data with this target (python regenerate.py "
                f"target.path={target_path} ...) or point target.path at the target that made it"
            )
