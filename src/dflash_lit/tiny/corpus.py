"""The pretraining corpus: the running interpreter's own standard-library ``.py`` sources.

Present on every machine with Python, so the embedded default needs no download. Files are
sorted by relative path and split train/held-out by a hash of that path, so the split is
stable across machines and runs (it does not depend on directory listing order).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: its path relative to the stdlib root and its text."""

    rel: str
    text: str


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Path | None = None, include_tests: bool = False) -> list[str]:
    """Relative paths (posix, sorted) of the stdlib's ``.py`` files.

    ``site-packages`` is always skipped (it differs per environment); test directories are
    skipped unless ``include_tests``.
    """
    root = stdlib_root() if root is None else root
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory {root} does not exist (sysconfig 'stdlib').")
    out = []
    for p in root.rglob("*.py"):
        parts = set(p.relative_to(root).parts[:-1])
        if parts & _SKIP_DIRS or (not include_tests and parts & _TEST_DIRS):
            continue
        out.append(p.relative_to(root).as_posix())
    return sorted(out)


def stable_fraction(key: str) -> float:
    """A deterministic number in [0, 1) from ``key`` (sha256), independent of PYTHONHASHSEED."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def split_files(rels: list[str], heldout_frac: float = 0.02) -> tuple[list[str], list[str]]:
    """Split relative paths into (train, held-out) by a stable hash of each path."""
    if not 0.0 < heldout_frac < 1.0:
        raise ValueError(f"heldout_frac must be in (0, 1), got {heldout_frac}.")
    train = [r for r in rels if stable_fraction("split:" + r) >= heldout_frac]
    held = [r for r in rels if stable_fraction("split:" + r) < heldout_frac]
    return train, held


def read_files(rels: list[str], root: Path | None = None) -> list[SourceFile]:
    """Read files as UTF-8 (undecodable files are skipped: a few stdlib files are latin-1)."""
    root = stdlib_root() if root is None else root
    out = []
    for r in rels:
        try:
            text = (root / r).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append(SourceFile(r, text))
    return out
