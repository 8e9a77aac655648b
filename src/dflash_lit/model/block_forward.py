"""One batched drafter forward over every anchor block of every sequence."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from dflash_lit.model.drafter import DFlashDrafter
from dflash_lit.model.layout import BlockLayout
from dflash_lit.model.masks import build_mask


def draft_hidden(
    drafter: DFlashDrafter,
    embed: Callable[[Tensor], Tensor],
    target_hidden: Tensor,
    layout: BlockLayout,
    backend: str = "dense",
    compile_mask: bool = False,
) -> Tensor:
    """Final-normed drafter hidden states [B, N, Bs, d] for all blocks in one forward.

    ``embed`` is the target's frozen ``embed_tokens``; ``target_hidden`` [B, S, K·d] is the
    (possibly noised) fc input captured from the target.
    """
    b, n, bs = layout.block_ids.shape
    noise_emb = embed(layout.block_ids.flatten(1)).to(target_hidden.dtype)
    mask = build_mask(layout, backend, compile=compile_mask, window=drafter.config.sliding_window)
    h = drafter(
        noise_embedding=noise_emb,
        target_hidden=target_hidden,
        position_ids=layout.position_ids(),
        attention_mask=mask,
    )
    return h.view(b, n, bs, -1)
