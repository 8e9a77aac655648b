"""Paths recorded in shipped files are relative to the repository, never the build machine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_lit.resolvers import repo_root


def repo_relative(value: Any, root: str | Path | None = None) -> Any:
    """``value`` with every absolute path string under ``root`` (default: the repo) made relative.

    Walks dicts and lists; other strings and values are returned unchanged. The root itself
    becomes ``.``.
    """
    base = Path(root or repo_root()).resolve()
    if isinstance(value, dict):
        return {k: repo_relative(v, base) for k, v in value.items()}
    if isinstance(value, list):
        return [repo_relative(v, base) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        try:
            return str(Path(value).relative_to(base))
        except ValueError:  # outside the repository: keep as given
            return value
    return value
