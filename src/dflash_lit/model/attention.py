"""Attention kernels for the drafter: SDPA, flex (GPU) and the CPU blockwise path.

The training layout's visibility is two-part: a block's queries see a prefix of the context
and their own block only. ``blockwise_attention`` computes exactly that without the dense
[Q, S+Q] score matrix: scores against the context [Q, S] plus per-block scores [N, Bs, Bs],
softmaxed jointly, so FLOPs drop from Q·(S+Q) to Q·(S+Bs) (the saving the flex BlockMask
gets on GPU) with an autograd backward on CPU. Measured (bench/attention_layout.py): 1.35-2.4x
faster than the dense mask with 512 anchors at 1-2k context, slower with few anchors, and it
keeps its [Q, S] probabilities for backward, which torch's fused CPU SDPA does not: the dense
path stays the CPU default and ``attention=blockwise`` is the option for many-anchor runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_lit.model.masks import BlockwiseMask

try:  # flex_attention is the GPU training path; CPU can run its forward only.
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]
    flex_attention = None  # type: ignore[assignment]


def blockwise_attention(q: Tensor, k: Tensor, v: Tensor, mask: BlockwiseMask) -> Tensor:
    """q [B, H, Q, D]; k, v [B, Hkv, S+Q, D] (context keys, then block keys) -> [B, H, Q, D]."""
    b, h, q_len, dim = q.shape
    s, bs = mask.context_len, mask.block_size
    n = q_len // bs
    rep = h // k.shape[1]
    if rep > 1:  # GQA: share each kv head across its query group
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = dim**-0.5
    k_ctx, v_ctx = k[:, :, :s], v[:, :, :s]
    k_blk, v_blk = k[:, :, s:].reshape(b, h, n, bs, dim), v[:, :, s:].reshape(b, h, n, bs, dim)
    s_ctx = (q @ k_ctx.transpose(-1, -2)) * scale  # [B, H, Q, S]
    s_ctx = s_ctx.masked_fill(~mask.context, float("-inf"))
    q_blk = q.reshape(b, h, n, bs, dim)
    s_blk = (q_blk @ k_blk.transpose(-1, -2)) * scale  # [B, H, N, Bs, Bs], never masked
    scores = torch.cat([s_ctx.reshape(b, h, n, bs, s), s_blk], dim=-1)
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = p[..., :s].reshape(b, h, q_len, s) @ v_ctx
    return out + (p[..., s:] @ v_blk).reshape(b, h, q_len, dim)


# Eager flex_attention materialises the whole score matrix (torch warns so); compiled, it runs
# the block-sparse kernel the BlockMask is for. Tools set this False to time the eager path.
COMPILE_FLEX_ON_CUDA = True


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)


def flex(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, gqa: bool) -> Tensor:
    """flex_attention with the BlockMask: compiled on CUDA, eager elsewhere (CPU forward only)."""
    if q.dtype != v.dtype or k.dtype != v.dtype:
        # Under autocast the RMSNorm'd q/k stay fp32 while v is bf16; flex is not an autocast
        # op (SDPA is, and casts all three down): cast as SDPA would.
        q, k = q.to(v.dtype), k.to(v.dtype)
    fn = _compiled_flex() if q.is_cuda and COMPILE_FLEX_ON_CUDA else flex_attention
    return fn(q, k, v, block_mask=mask, enable_gqa=gqa)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | BlockwiseMask | None) -> Tensor:
    """Dispatch on the mask type: BlockwiseMask, flex BlockMask, dense bool mask or none."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockwiseMask):
        return blockwise_attention(q, k, v, mask)
    if BlockMask is not None and isinstance(mask, BlockMask):
        return flex(q, k, v, mask, gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
