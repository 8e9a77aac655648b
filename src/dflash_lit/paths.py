"""Paths recorded in shipped files are relative to the repository (or to ``$DFLASH_CACHE`` for
built targets), never the build machine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_lit.resolvers import dflash_cache, repo_root


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
        for anchor, name in ((base, None), (Path(dflash_cache()).resolve(), "$DFLASH_CACHE")):
            try:
                rel = path.relative_to(anchor)
            except ValueError:
                continue
            return str(rel) if name is None else f"{name}/{rel}"
        return value  # outside the repository and the cache: keep as given
    return value
