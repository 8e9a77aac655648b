"""Resolve ``ckpt_path=last``: the newest ``last.ckpt`` of an earlier run of the same job.

A job is identified by its run_name directory (outputs/<run_name>/) and its Hydra command-line
overrides (minus ``ckpt_path`` and ``hydra.*``), read from each run's ``.hydra/overrides.yaml``.
So ``python train.py experiment=v5_hardce ckpt_path=last`` continues the latest
``experiment=v5_hardce`` run, and each job of a resumed multirun finds its own predecessor.
"""

from __future__ import annotations

from pathlib import Path

import yaml


def _job_overrides(overrides: list[str]) -> list[str]:
    keep = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in ("ckpt_path",) or key.startswith("hydra."):
            continue
        keep.append(o)
    return sorted(keep)


def find_last_checkpoint(run_root: Path, overrides: list[str], exclude: Path | None) -> Path:
    """Newest ``*/checkpoints/last.ckpt`` under ``run_root`` whose run had the same overrides."""
    want = _job_overrides(overrides)
    found: list[tuple[float, Path]] = []
    for ckpt in run_root.glob("**/checkpoints/last.ckpt"):
        run_dir = ckpt.parent.parent
        if exclude is not None and run_dir.resolve() == exclude.resolve():
            continue
        ov_file = run_dir / ".hydra" / "overrides.yaml"
        ov = yaml.safe_load(ov_file.read_text()) if ov_file.is_file() else []
        if _job_overrides(ov or []) == want:
            found.append((ckpt.stat().st_mtime, ckpt))
    if not found:
        raise FileNotFoundError(
            f"ckpt_path=last: no earlier run under {run_root} with overrides {want} has "
            "checkpoints/last.ckpt; pass ckpt_path=<path/to/file.ckpt> instead"
        )
    return max(found)[1]


def resolve_ckpt_path(
    spec: str | None, run_root: Path, overrides: list[str], run_dir: Path
) -> Path | None:
    """``None`` (fresh run), ``last`` (see module doc) or an explicit path that must exist."""
    if spec in (None, "", "null"):
        return None
    if spec == "last":
        return find_last_checkpoint(run_root, overrides, exclude=run_dir)
    p = Path(spec).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"ckpt_path={spec}: no such checkpoint file")
    return p
