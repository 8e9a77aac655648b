"""Where a block may be anchored: a property of a row's loss mask, shared by training's
anchor sampling and the offline evaluation."""

from __future__ import annotations

import torch
from torch import Tensor


def anchor_candidates(loss_mask: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Bool [B, S]: positions a >= 1 whose next token is a completion token.

    A block anchored at a sees context < a, so a = 0 (no context) is never a candidate.
    """
    lm = loss_mask.bool()
    cand = torch.zeros_like(lm)
    cand[:, :-1] = lm[:, 1:]
    cand[:, 0] = False
    if attention_mask is not None:
        cand &= attention_mask.bool()
    return cand
