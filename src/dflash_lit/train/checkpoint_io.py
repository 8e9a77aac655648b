"""Atomic checkpoint writes: a kill mid-save never leaves a file that loads wrong.

Lightning's default IO streams the pickle straight into the final path, so a SIGKILL during a
save leaves a truncated ``last.ckpt``. Here every checkpoint is written to a temporary name in
the same directory, flushed and fsync'ed, then ``os.replace``d over the target (atomic on
POSIX) and the directory entry fsync'ed. Loads fail with one line naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from dflash_lit.atomic import atomic_write
from dflash_lit.errors import UserError


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` via tmp + fsync + rename."""
    atomic_write(path, lambda f: torch.save(obj, f), what="checkpoint",
                 intact="the previous checkpoints in that directory are intact")


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO with atomic saves and readable load errors."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"checkpoint {p} does not exist")
        try:
            return torch.load(p, map_location=map_location or "cpu", weights_only=False)
        except Exception as e:
            raise UserError(
                f"checkpoint {p} is corrupt or truncated ({type(e).__name__}: {e}); resume from "
                "an earlier checkpoint in the same directory"
            ) from None
