"""OmegaConf resolvers used by the Hydra configs (registered on import)."""

from __future__ import annotations

from omegaconf import OmegaConf

from dflash_lit.paths import cache_root, repo_root


def dflash_cache() -> str:
    """Cache of built targets: ``$DFLASH_CACHE`` or ``~/.cache/dflash-lit`` (``~`` expanded)."""
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
