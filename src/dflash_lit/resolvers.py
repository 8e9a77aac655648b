"""OmegaConf resolvers used by the Hydra configs (registered on import)."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf


def repo_root() -> str:
    """The checkout root (holds conf/ and artifacts/); DFLASH_ROOT overrides, cwd is the fallback."""
    env = os.environ.get("DFLASH_ROOT")
    if env:
        return str(Path(env).resolve())
    here = Path(__file__).resolve().parents[2]  # src/dflash_lit/resolvers.py -> repo
    return str(here if (here / "conf").is_dir() else Path.cwd())


def dflash_cache() -> str:
    """Cache of built targets: ``$DFLASH_CACHE`` or ``~/.cache/dflash-lit`` (``~`` expanded)."""
    from dflash_lit.targets import cache_root

    return str(cache_root())


def cpu_precision() -> str:
    """``bf16-mixed`` where this CPU measures bf16 matmuls faster, else ``32-true``."""
    from dflash_lit.precision import cpu_precision as measure

    return measure()


def register() -> None:
    if not OmegaConf.has_resolver("repo_root"):
        OmegaConf.register_new_resolver("repo_root", repo_root)
    if not OmegaConf.has_resolver("dflash_cache"):
        OmegaConf.register_new_resolver("dflash_cache", dflash_cache)
    if not OmegaConf.has_resolver("cpu_precision"):
        OmegaConf.register_new_resolver("cpu_precision", cpu_precision)


register()
