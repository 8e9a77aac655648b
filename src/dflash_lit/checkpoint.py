"""The checkpoint contract: what a dflash-lit training checkpoint holds, and every reader of it.

A training checkpoint is a Lightning checkpoint (written atomically by
``train/checkpointing.py``) with:

- ``state_dict``: ``drafters.<name>.<z-lab tensor name>`` for every drafter, plus persistent
  metric states (``train_metrics.*``); never the target's weights;
- optimizer, LR-scheduler, loop, callback and datamodule (sampler position) states, so a resume
  continues with the exact next batch;
- ``checkpoint["dflash"]`` (:func:`make_meta`)::

    {"version": CKPT_VERSION,
     "drafters": {name: {"config": DFlashConfig.to_dict(), "loss": {...}}},
     "target": {"path" | "build", "layer_ids", "hidden_size", "num_layers", "vocab_size"},
     "optimizer": "adamw" | "muon",
     "nonfinite_total": int, "tokens_seen": int, "nonfinite_in_row": int,
     "train_vocab": [int, ...] | None}   # ids of the reduced training softmax (train_vocab)

Every reader loads with :func:`safe_load` (``weights_only=True``): a checkpoint file never runs
code. Training writes it (``DFlashModule.on_save_checkpoint``) and refuses to resume from one made by
another setup (:func:`check_matches`); evaluation and export read only ``dflash`` and the
drafter tensors (:func:`read`, :func:`drafter_state`), so they need neither Lightning nor the
training config. When checkpoints are written is ``train/checkpointing.py``; which one
``ckpt_path=last`` resumes is ``train/resume.py``.
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from dflash_lit.errors import UserError

# Raise CKPT_VERSION when the ``dflash`` entry changes incompatibly; list the versions the
# readers still understand in SUPPORTED_CKPT_VERSIONS.
CKPT_VERSION = 1
SUPPORTED_CKPT_VERSIONS = (CKPT_VERSION,)

DRAFTER_PREFIX = "drafters."  # state_dict keys of drafter <name>: "drafters.<name>.<tensor>"

# Config fields whose change makes old weights or optimizer moments meaningless.
_SHAPE_FIELDS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "num_hidden_layers", "block_size", "target_layer_ids",
    "mask_token_id", "num_target_layers",
)
_TARGET_FIELDS = ("hidden_size", "num_layers", "vocab_size")


def make_meta(drafters: dict[str, tuple[dict[str, Any], dict[str, Any]]],
              target: dict[str, Any], optimizer: str = "adamw",
              train_vocab: list[int] | None = None, **counters: int) -> dict[str, Any]:
    """The ``dflash`` entry: ``drafters`` maps name -> (DFlashConfig dict, loss settings);
    ``optimizer`` is ``optim.name`` (its state's layout differs between adamw and muon);
    ``train_vocab`` the reduced training softmax's ids, which evaluation can draft over."""
    return {
        "version": CKPT_VERSION,
        "drafters": {n: {"config": dict(c), "loss": dict(loss)} for n, (c, loss) in drafters.items()},
        "target": dict(target),
        "optimizer": optimizer,
        "train_vocab": None if train_vocab is None else [int(i) for i in train_vocab],
        **{k: int(v) for k, v in counters.items()},
    }


def check_matches(ckpt: dict[str, Any], current: dict[str, Any], source: str) -> None:
    """Raise a one-line UserError when ``ckpt`` was made by a different drafter/target setup."""
    meta = ckpt.get("dflash")
    if meta is None:
        raise UserError(f"{source}: not a dflash-lit training checkpoint (no 'dflash' entry)")
    old, new = meta.get("drafters", {}), current["drafters"]
    if set(old) != set(new):
        raise UserError(
            f"{source}: drafters {sorted(old)} in the checkpoint, {sorted(new)} in the config; "
            "resume with the same drafters: config"
        )
    for name in new:
        a, b = old[name]["config"], new[name]["config"]
        for f in _SHAPE_FIELDS:
            if a.get(f) != b.get(f):
                raise UserError(
                    f"{source}: drafter {name!r} has {f}={a.get(f)} in the checkpoint but "
                    f"{b.get(f)} in the config; resume with the same drafter shape"
                )
    oa, ob = meta.get("optimizer", "adamw"), current.get("optimizer", "adamw")
    if oa != ob:  # checkpoints older than optim=muon have no entry: they are AdamW ones
        raise UserError(f"{source}: trained with optim={oa}, the config has optim={ob}; resume "
                        "with the same optimizer")
    ta, tb = meta.get("target", {}), current.get("target", {})
    for f in _TARGET_FIELDS:
        if f in ta and f in tb and ta[f] != tb[f]:
            raise UserError(
                f"{source}: target {f}={ta[f]} in the checkpoint but {tb[f]} now; this "
                "checkpoint was trained against another target"
            )


TRUST_KEY = "trust_checkpoint"  # the config key that opts into unpickling a trusted legacy file


def _refused_global(message: str) -> str | None:
    """The object a weights-only load refused ("posix.system"), from torch's message; None when
    the file failed for another reason (not a pickle at all, cut off)."""
    m = re.search(r"GLOBAL ([\w.]+)", message)
    return m.group(1) if m else None


def _short_reason(e: Exception) -> str:
    """``Type: reason`` of a failed load, without torch's paragraph about ``weights_only``."""
    msg = str(e)
    if "WeightsUnpickler error:" in msg:
        msg = msg.split("WeightsUnpickler error:", 1)[1].split("Check the documentation")[0]
    return f"{type(e).__name__}: {' '.join(msg.split())}"


def safe_load(path: str | Path, trust: bool = False, key: str = "ckpt") -> Any:
    """``torch.load`` that runs no code from the file: ``weights_only=True`` (tensors and plain
    containers only, which is all dflash-lit writes). A file holding other pickled objects is
    refused with one line naming it; ``trust=True`` (config ``trust_checkpoint=true``, for a
    legacy file from a source you trust) unpickles it with a warning. A file that is not a torch
    checkpoint at all, or is cut off, is one line too."""
    p = Path(path)
    unreadable = (f"{key}={p}: not a readable checkpoint ({{}}); pass a training .ckpt file or "
                  "a z-lab drafter directory")
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        bad = _refused_global(str(e))
        if bad is None:
            raise UserError(unreadable.format(_short_reason(e))) from None
        if not trust:
            raise UserError(
                f"{key}={p}: refused: it holds a pickled {bad}, which could run code when "
                "loaded (dflash-lit checkpoints hold tensors and plain values only); only if "
                f"you trust its source, pass {TRUST_KEY}=true"
            ) from None
    except Exception as e:  # not a torch file at all, or cut off mid-write
        raise UserError(unreadable.format(_short_reason(e))) from None
    warnings.warn(f"{key}={p}: unpickling {bad} because {TRUST_KEY}=true", stacklevel=2)
    try:
        return torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:
        raise UserError(unreadable.format(_short_reason(e))) from None


def read(path: str | Path, trust: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checkpoint dict, its ``dflash`` entry), loaded by :func:`safe_load`; one-line errors
    for files that are not ours."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: checkpoint not found (ckpt= must be a .ckpt file or a z-lab dir)")
    ckpt = safe_load(p, trust)
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


def loader_world_size(ckpt: dict[str, Any]) -> int | None:
    """How many processes the training checkpoint's data position belongs to (the bucket
    sampler's saved ``world_size``), or None when it holds no loader state."""
    try:
        loaders = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    except (KeyError, TypeError):
        return None
    for state in loaders if isinstance(loaders, list) else [loaders]:
        sampler = (state or {}).get("_index_sampler_state") if isinstance(state, dict) else None
        if isinstance(sampler, dict) and "world_size" in sampler:
            return int(sampler["world_size"])
    return None


def drafter_state(state_dict: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """Drafter ``name``'s tensors under their z-lab names."""
    prefix = f"{DRAFTER_PREFIX}{name}."
    out = {}
    for k, v in state_dict.items():
        if k.startswith(prefix):
            # torch.compile wraps modules as ``_orig_mod``; the weights are the same.
            out[k[len(prefix):].replace("_orig_mod.", "")] = v
    return out
