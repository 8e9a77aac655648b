"""Naive reference: each block run on its own, with exactly its visible context slice.

Slow (one forward per block) and obviously right: the batched layout and both mask backends
are tested against it, and ``bench/`` uses it as the "one forward per block" baseline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dflash_lit.model.drafter import DFlashDrafter
from dflash_lit.model.layout import BlockLayout


def reference_draft_hidden(
    drafter: DFlashDrafter,
    embed: Callable[[Tensor], Tensor],
    target_hidden: Tensor,
    layout: BlockLayout,
) -> Tensor:
    """[B, N, Bs, d]; zeros for invalid blocks. Uses the drafter's unmasked call, given only
    the context positions the block sees: [a - sliding_window, a) (all of [0, a) without a
    window), real tokens only."""
    b, n, bs = layout.block_ids.shape
    d = drafter.config.hidden_size
    window = drafter.config.sliding_window
    out = torch.zeros(b, n, bs, d, dtype=target_hidden.dtype, device=target_hidden.device)
    for bi in range(b):
        for ni in range(n):
            if not layout.valid[bi, ni]:
                continue
            a = int(layout.anchors[bi, ni])
            lo = 0 if window is None else max(a - window, 0)
            keep = lo + layout.context_valid[bi, lo:a].nonzero().flatten()  # real, in [lo, a)
            ctx = target_hidden[bi, keep][None]
            pos = torch.cat([keep, layout.block_pos[bi, ni]])[None]
            emb = embed(layout.block_ids[bi, ni][None]).to(target_hidden.dtype)
            out[bi, ni] = drafter(noise_embedding=emb, target_hidden=ctx, position_ids=pos)[0]
    return out
