"""Where things live: the repository checkout, the cache of built targets, and paths recorded
in shipped files, which are relative to the repository (or to ``$DFLASH_CACHE`` for built
targets), never the build machine's. The Hydra configs reach the first two through the
``${repo_root:}`` and ``${dflash_cache:}`` resolvers (``resolvers.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def repo_root() -> str:
    """The checkout root (holds conf/ and artifacts/); DFLASH_ROOT overrides, cwd is the fallback."""
    env = os.environ.get("DFLASH_ROOT")
    if env:
        return str(Path(env).resolve())
    here = Path(__file__).resolve().parents[2]  # src/dflash_lit/paths.py -> repo
    return str(here if (here / "conf").is_dir() else Path.cwd())


def cache_root() -> Path:
    """Where built targets live: ``$DFLASH_CACHE`` or ``~/.cache/dflash-lit`` (``~`` expanded)."""
    return Path(os.environ.get("DFLASH_CACHE") or "~/.cache/dflash-lit").expanduser()


def repo_relative(value: Any, root: str | Path | None = None) -> Any:
    """``value`` with every absolute path string under ``root`` (default: the repo) made relative.

    Walks dicts and lists; other strings and values are returned unchanged. The root itself
    becomes ``.``; a path under the built-target cache becomes ``$DFLASH_CACHE/...``.
    """
    base = Path(root or repo_root()).resolve()
    if isinstance(value, dict):
        return {k: repo_relative(v, base) for k, v in value.items()}
    if isinstance(value, list):
        return [repo_relative(v, base) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        path = Path(value)
        for anchor, name in ((base, None), (cache_root().resolve(), "$DFLASH_CACHE")):
            for p in (path, path.resolve()):  # as given, then through symlinks
                try:
                    rel = p.relative_to(anchor)
                except ValueError:
                    continue
                return str(rel) if name is None else f"{name}/{rel}"
        return value  # outside the repository and the cache: keep as given
    return value
