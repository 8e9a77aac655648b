"""Load a drafter for evaluation / export (whether it fits a target: ``dflash_lit.compat``).

Two sources:
- a Lightning training checkpoint (``.ckpt``): ``state_dict`` keys
  ``drafters.<name>.<z-lab tensor name>`` and ``ckpt["dflash"]`` =
  ``{"version": 1, "drafters": {name: {"config": DFlashConfig.to_dict()}},
  "target": {"path", "layer_ids", "hidden_size", "num_layers", "vocab_size"}}``;
- a z-lab directory (``config.json`` + ``model.safetensors``: our export or a published one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_lit.checkpoint_format import SUPPORTED_CKPT_VERSIONS
from dflash_lit.errors import UserError
from dflash_lit.model.config import DFlashConfig
from dflash_lit.model.drafter import CONFIG_NAME, DFlashDrafter


@dataclass
class DrafterInfo:
    """Where a drafter came from and what its training target was (when recorded)."""

    source: str  # "ckpt" or "zlab"
    path: str
    name: str | None = None  # drafter name inside a training checkpoint
    available: list[str] = field(default_factory=list)  # all drafter names in the checkpoint
    target: dict[str, Any] = field(default_factory=dict)  # ckpt["dflash"]["target"], {} for z-lab
    global_step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "path": self.path, "name": self.name,
            "available": list(self.available), "target": dict(self.target),
            "global_step": self.global_step,
        }


def _torch_load(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # Lightning checkpoints may pickle config objects (e.g. OmegaConf)
        pass
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # not a torch file at all, or cut off mid-write
        raise UserError(
            f"ckpt={path}: not a readable checkpoint ({type(e).__name__}: {e}); pass a training "
            ".ckpt file or a z-lab drafter directory"
        ) from None


def read_checkpoint_meta(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checkpoint dict, its ``dflash`` entry); clear errors for files that are not ours."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: checkpoint not found (ckpt= must be a .ckpt file or a z-lab dir)")
    ckpt = _torch_load(p)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise UserError(f"{p}: not a Lightning checkpoint (no 'state_dict' entry)")
    meta = ckpt.get("dflash")
    if not isinstance(meta, dict) or "drafters" not in meta:
        raise UserError(
            f"{p}: no 'dflash' metadata in the checkpoint; it was not written by dflash-lit's "
            "training module (for a published drafter pass its z-lab directory instead)"
        )
    version = meta.get("version")
    if version not in SUPPORTED_CKPT_VERSIONS:
        raise UserError(
            f"{p}: dflash checkpoint version {version!r} is not supported "
            f"(this code reads versions {list(SUPPORTED_CKPT_VERSIONS)})"
        )
    return ckpt, meta


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


def _drafter_state(state_dict: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    prefix = f"drafters.{name}."
    out = {}
    for k, v in state_dict.items():
        if k.startswith(prefix):
            # torch.compile wraps modules as ``_orig_mod``; the weights are the same.
            out[k[len(prefix):].replace("_orig_mod.", "")] = v
    return out


def load_drafter(
    path: str | Path,
    name: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> tuple[DFlashDrafter, DrafterInfo]:
    """Load a drafter from a training ``.ckpt`` (``name`` picks one) or a z-lab directory.

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
        return drafter.eval(), DrafterInfo(source="zlab", path=str(p))
    ckpt, meta = read_checkpoint_meta(p)
    chosen, names = _pick_name(meta, name, str(p))
    entry = meta["drafters"][chosen]
    try:
        cfg = DFlashConfig(**entry["config"])
    except (KeyError, TypeError) as e:
        raise UserError(f"{p}: drafter {chosen!r} has no usable config ({e})") from None
    state = _drafter_state(ckpt["state_dict"], chosen)
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
    )
    return drafter.eval(), info


def _common_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in state.values()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32
