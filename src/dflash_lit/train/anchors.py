"""Anchor sampling: where blocks start, drawn reproducibly from (seed, step, rank)."""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_lit.data.anchors import anchor_candidates
from dflash_lit.hashing import seed_from


def step_generator(seed: int, step: int, rank: int, salt: str = "anchors") -> torch.Generator:
    """A CPU generator whose state is a pure function of (seed, step, rank, salt).

    Everything random per training step derives from this, so resume needs no saved RNG.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(seed_from(salt, seed, step, rank))
    return g


def sample_anchors(
    loss_mask: Tensor,
    max_anchors: int,
    generator: torch.Generator,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample ``min(max_anchors, #candidates)`` anchors per sequence without replacement.

    Returns ``anchors`` LongTensor [B, N] sorted ascending per row (invalid slots hold 0 and
    come last) and ``valid`` BoolTensor [B, N]; N = min(max_anchors, max #candidates).
    Sorting keeps blocks of nearby anchors together, which makes the block-sparse mask denser
    per tile.
    """
    if max_anchors < 1:
        raise ValueError(f"max_anchors={max_anchors}: need at least 1 anchor per sequence")
    cand = anchor_candidates(loss_mask, attention_mask).cpu()
    b, s = cand.shape
    n = int(min(max_anchors, int(cand.sum(1).max().item()) if b else 0))
    if n == 0:
        empty = torch.zeros(b, 0, dtype=torch.long)
        return empty.to(loss_mask.device), empty.bool().to(loss_mask.device)
    # Uniform keys + top-k = sampling without replacement; non-candidates get key -1.
    keys = torch.rand(b, s, generator=generator)
    keys = torch.where(cand, keys, torch.full_like(keys, -1.0))
    top, idx = keys.topk(n, dim=1)
    valid = top >= 0
    # Sort valid anchors ascending; push invalid ones to the end.
    sort_key = torch.where(valid, idx, torch.full_like(idx, s + 1))
    order = sort_key.argsort(dim=1)
    anchors = torch.gather(idx, 1, order)
    valid = torch.gather(valid, 1, order)
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def fixed_anchors(loss_mask: Tensor, max_anchors: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Validation anchors: the same for a given batch content whatever the step or run."""
    return sample_anchors(loss_mask, max_anchors, step_generator(seed, 0, 0, salt="val"))
