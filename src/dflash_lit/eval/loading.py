"""Load a drafter for evaluation / export (whether it fits a target: ``dflash_lit.compat``).

Two sources:
- a training checkpoint (``.ckpt``; its contract is ``dflash_lit/checkpoint.py``);
- a z-lab directory (``config.json`` + ``model.safetensors``: our export or a published one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_lit.checkpoint import drafter_state, read
from dflash_lit.errors import UserError
from dflash_lit.model.config import DFlashConfig
from dflash_lit.model.drafter import CONFIG_NAME, DFlashDrafter
from dflash_lit.paths import repo_root


@dataclass
class DrafterInfo:
    """Where a drafter came from and what its training target was (when recorded)."""

    source: str  # "ckpt" or "zlab"
    path: str
    name: str | None = None  # drafter name inside a training checkpoint
    available: list[str] = field(default_factory=list)  # all drafter names in the checkpoint
    target: dict[str, Any] = field(default_factory=dict)  # ckpt["dflash"]["target"], {} for z-lab
    global_step: int | None = None
    train_vocab: list[int] | None = None  # ids of the reduced training softmax, when recorded

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "path": self.path, "name": self.name,
            "available": list(self.available), "target": dict(self.target),
            "global_step": self.global_step,
            "train_vocab_size": None if self.train_vocab is None else len(self.train_vocab),
        }


def _pick_name(meta: dict[str, Any], name: str | None, where: str) -> tuple[str, list[str]]:
    names = sorted(meta["drafters"])
    if not names:
        raise UserError(f"{where}: the checkpoint lists no drafters")
    if name is None:
        if len(names) > 1:
            raise UserError(
                f"{where} holds {len(names)} drafters {names}; choose one with drafter=<name>"
            )
        return names[0], names
    if name not in meta["drafters"]:
        raise UserError(f"{where}: no drafter named {name!r}; available: {names}")
    return name, names


def load_drafter(
    path: str | Path,
    name: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    trust: bool = False,
) -> tuple[DFlashDrafter, DrafterInfo]:
    """Load a drafter from a training ``.ckpt`` (``name`` picks one) or a z-lab directory.

    Neither runs code from the files: a ``.ckpt`` loads weights-only (``trust=True`` unpickles
    a trusted legacy file, ``checkpoint.safe_load``), a directory reads JSON + safetensors.

    Returns the drafter in eval mode and a ``DrafterInfo``. With a checkpoint holding several
    drafters and no ``name``, or an unknown ``name``, the error lists the available names.
    """
    p = Path(path)
    if p.is_dir():
        if not (p / CONFIG_NAME).is_file():
            raise FileNotFoundError(
                f"{p}: a directory but no {CONFIG_NAME}; pass a z-lab drafter directory "
                "(config.json + model.safetensors) or a training .ckpt file"
            )
        drafter = DFlashDrafter.from_pretrained(p, dtype=dtype, device=device)
        return drafter.eval(), DrafterInfo(source="zlab", path=str(p), target=_recorded_target(p))
    ckpt, meta = read(p, trust)
    chosen, names = _pick_name(meta, name, str(p))
    entry = meta["drafters"][chosen]
    try:
        cfg = DFlashConfig(**entry["config"])
    except (KeyError, TypeError) as e:
        raise UserError(f"{p}: drafter {chosen!r} has no usable config ({e})") from None
    state = drafter_state(ckpt["state_dict"], chosen)
    if not state:
        raise UserError(
            f"{p}: no state_dict tensors under 'drafters.{chosen}.'; the metadata and the weights "
            "disagree (was the checkpoint written by a different module layout?)"
        )
    drafter = DFlashDrafter(cfg)
    drafter.load_exact_state_dict(state, source=f"{p} [drafter {chosen}]")
    drafter.to(device=device, dtype=dtype or _common_dtype(state))
    info = DrafterInfo(
        source="ckpt", path=str(p), name=chosen, available=names,
        target=dict(meta.get("target") or {}), global_step=ckpt.get("global_step"),
        train_vocab=meta.get("train_vocab"),
    )
    return drafter.eval(), info


def _recorded_target(drafter_dir: Path) -> dict[str, Any]:
    """The target an export recorded (``dflash_target`` in its config.json; {} for a z-lab
    directory from elsewhere). A repository-relative path is made absolute when it exists."""
    try:
        target = dict(json.loads((drafter_dir / CONFIG_NAME).read_text()).get("dflash_target") or {})
    except (OSError, ValueError, AttributeError):
        return {}
    path = target.get("path")
    if path and not Path(path).is_absolute() and (Path(repo_root()) / path).exists():
        target["path"] = str(Path(repo_root()) / path)
    return target


def _common_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in state.values()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32
