"""Attention masks for the training layout: dense boolean (CPU/SDPA) and flex BlockMask (GPU).

Visibility (docs/ARCHITECTURE.md §2): a block anchored at a sees real context keys at positions < a
(strictly: the anchor has not been through the target at inference) and every key of its own
block (bidirectional). Nothing else. With a sliding ``window`` (``drafter.sliding_window``)
only the context keys at positions >= a - window. Invalid (padding) blocks see only their own
block, so no query row is fully masked (SDPA would return NaN for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflash_lit.model.layout import BlockLayout


def context_visible(layout: BlockLayout, window: int | None = None) -> Tensor:
    """Bool [B, Q, S]: the real context keys each query sees, positions [a - window, a) of its
    block's anchor a (all of [0, a) when ``window`` is None)."""
    kv_pos = torch.arange(layout.context_len, device=layout.anchors.device)[None, None, :]
    q_anchor = layout.query_anchor()[:, :, None]  # [B, Q, 1]
    visible = (kv_pos < q_anchor) & layout.context_valid[:, None, :]
    if window is not None:
        visible &= kv_pos >= q_anchor - window
    return visible


def dense_mask(layout: BlockLayout, window: int | None = None) -> Tensor:
    """Bool [B, 1, Q, S+Q], True = attend. Memory is O(Q·(S+Q)): the CPU training path."""
    b = layout.context_valid.shape[0]
    bs = layout.block_size
    q = layout.num_blocks * bs
    dev = layout.anchors.device
    ctx = context_visible(layout, window)
    qb = torch.arange(q, device=dev) // bs
    blk = (qb[:, None] == qb[None, :]).expand(b, q, q)
    return torch.cat([ctx, blk], dim=2)[:, None]


@dataclass
class BlockwiseMask:
    """The layout's visibility in factored form for ``attention.blockwise_attention``.

    ``context`` [B, 1, Q, S] says which context keys each query sees; every query also sees
    all Bs keys of its own block (and no other block), so that part needs no tensor.
    """

    context: Tensor
    block_size: int
    _additive: dict[torch.dtype, Tensor] = field(default_factory=dict, repr=False)

    @property
    def context_len(self) -> int:
        return self.context.shape[-1]

    def additive(self, dtype: torch.dtype) -> Tensor:
        """``context`` as an additive float mask (0 = attend, -inf = not), built once per
        dtype and shared by every layer of a forward."""
        if dtype not in self._additive:
            self._additive[dtype] = torch.zeros(self.context.shape, dtype=dtype,
                                                device=self.context.device).masked_fill_(
                                                    ~self.context, float("-inf"))
        return self._additive[dtype]


def blockwise_mask(layout: BlockLayout, window: int | None = None) -> BlockwiseMask:
    """Factored mask: O(Q·S) memory instead of the dense O(Q·(S+Q)). Trains on CPU."""
    return BlockwiseMask(context=context_visible(layout, window)[:, None],
                         block_size=layout.block_size)


def flex_block_mask(layout: BlockLayout, compile: bool = False, block: int = 128,
                    window: int | None = None):
    """flex_attention ``BlockMask`` (one mask for all heads: ``H=None``).

    Block-sparse: tiles wholly outside a block's visible context are skipped, so cost scales
    with N·Bs·(mean visible context) rather than Q·(S+Q) (with a ``window``, about
    N·Bs·window at most, up to tile edges). Pass ``compile=True`` on GPU so the dense [Q, KV]
    mask is never materialised while building it.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    b, s = layout.context_valid.shape
    bs = layout.block_size
    q = layout.num_blocks * bs
    q_anchor = layout.query_anchor()
    ctx_valid = layout.context_valid

    def mask_mod(bi, hi, q_idx, kv_idx):
        is_ctx = kv_idx < s
        kv_c = torch.clamp(kv_idx, max=s - 1)
        ctx_ok = (kv_idx < q_anchor[bi, q_idx]) & ctx_valid[bi, kv_c]
        if window is not None:
            ctx_ok = ctx_ok & (kv_idx >= q_anchor[bi, q_idx] - window)
        blk_ok = (kv_idx - s) // bs == q_idx // bs
        return torch.where(is_ctx, ctx_ok, blk_ok)

    fn = torch.compile(create_block_mask) if compile else create_block_mask
    return fn(mask_mod, b, None, q, s + q, device=layout.anchors.device, BLOCK_SIZE=block)


def build_mask(layout: BlockLayout, backend: str, compile: bool = False,
               window: int | None = None):
    """``backend``: ``blockwise`` (factored, trains on CPU), ``dense`` (bool mask + SDPA, any
    device) or ``flex`` (block-sparse, GPU training); ``window``: the drafter's sliding window."""
    if backend == "blockwise":
        return blockwise_mask(layout, window)
    if backend == "dense":
        return dense_mask(layout, window)
    if backend == "flex":
        return flex_block_mask(layout, compile=compile, window=window)
    raise ValueError(f"attention backend {backend!r} unknown: use 'blockwise', 'dense' or 'flex'")

