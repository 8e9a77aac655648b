"""Dtype names accepted in configs (``target.dtype``, ``dtype=``, ``hf.dtype``) and their parsing."""

from __future__ import annotations

import torch

from dflash_lit.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(
    name: str | None, key: str, device: torch.device | None = None, keep: bool = False
) -> torch.dtype | None:
    """The torch dtype named by config key ``key``.

    ``auto`` is accepted when ``device`` is given: bfloat16 on a CUDA device that supports
    it, else float32. ``keep`` (or null) returns None when ``keep`` is allowed: the caller
    keeps the source's dtype.
    """
    value = "" if name is None else str(name)
    if keep and value in ("", "keep", "null", "None"):
        return None
    if value == "auto" and device is not None:
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    if value not in DTYPES:
        extra = (["auto"] if device is not None else []) + (["keep"] if keep else [])
        raise UserError(f"{key}={name!r}: choose one of {sorted(DTYPES) + extra}")
    return DTYPES[value]
