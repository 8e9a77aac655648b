"""Resolve ``ckpt_path=last``: the run directory's own ``last.ckpt``, else the newest one of
an earlier run of the same job.

1. ``<run dir>/checkpoints/last.ckpt``: a job relaunched in a fixed run directory
   (``hydra.run.dir=DIR``, as cluster job scripts do) continues itself.
2. Else the newest ``last.ckpt`` of an earlier run of the same job: same run_name directory
   (outputs/<run_name>/) and the same Hydra command-line overrides (minus ``ckpt_path``,
   ``resume_strict`` and ``hydra.*``), read from each run's ``.hydra/overrides.yaml``. So
   ``python train.py experiment=v5_hardce ckpt_path=last`` continues the latest
   ``experiment=v5_hardce`` run, and each job of a resumed multirun finds its own predecessor.
3. Else the run starts fresh with a warning (a job pre-empted before its first checkpoint),
   or fails when ``resume_strict=true``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from dflash_lit.errors import UserError

log = logging.getLogger(__name__)

_NOT_JOB_IDENTITY = ("ckpt_path", "resume_strict")


def _job_overrides(overrides: list[str]) -> list[str]:
    keep = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in _NOT_JOB_IDENTITY or key.startswith("hydra."):
            continue
        keep.append(o)
    return sorted(keep)


def find_last_checkpoint(run_root: Path, overrides: list[str], exclude: Path | None) -> Path | None:
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
    return max(found)[1] if found else None


def resolve_ckpt_path(
    spec: str | None, run_root: Path, overrides: list[str], run_dir: Path, strict: bool = False
) -> Path | None:
    """``None`` (fresh run), ``last`` (see module doc) or an explicit path that must exist."""
    if spec in (None, "", "null"):
        return None
    if spec == "last":
        own = run_dir / "checkpoints" / "last.ckpt"
        if own.is_file():
            return own
        found = find_last_checkpoint(run_root, overrides, exclude=run_dir)
        if found is not None:
            return found
        what = (f"ckpt_path=last: no checkpoints/last.ckpt in the run directory {run_dir} nor in "
                f"an earlier run under {run_root} with overrides {_job_overrides(overrides)}")
        if strict:
            raise UserError(f"{what} (resume_strict=true); pass ckpt_path=<path/to/file.ckpt> "
                            "or drop resume_strict to start fresh")
        log.warning("%s; starting fresh (resume_strict=true makes this an error)", what)
        return None
    p = Path(spec).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"ckpt_path={spec}: no such checkpoint file")
    return p
