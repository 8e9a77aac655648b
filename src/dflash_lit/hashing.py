"""Stable hashes: seeds derived from names and counters, file fingerprints.

Independent of ``PYTHONHASHSEED`` and of the machine, so anything seeded from them (per-step
anchors and noise, the data split) is the same on every rank, run and resume.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal


def blake2b_64(text: str, byteorder: Literal["little", "big"] = "little") -> int:
    """The 8-byte blake2b digest of ``text`` as an unsigned int."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), byteorder)


def seed_from(*parts: Any) -> int:
    """A 63-bit seed (what ``torch.Generator.manual_seed`` takes) from ``parts`` joined by ':'."""
    return blake2b_64(":".join(map(str, parts))) & ((1 << 63) - 1)


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB blocks (``progress(bytes)`` after each)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
            if progress:
                progress(len(block))
    return h.hexdigest()
