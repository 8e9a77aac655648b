"""Attention kernels for the drafter: SDPA, flex (GPU) and the blockwise path (CPU).

The training layout's visibility is two-part: a block's queries see a prefix of the context
and their own block only. ``blockwise_attention`` computes exactly that without the dense
[Q, S+Q] score matrix, so FLOPs drop from Q·(S+Q) to Q·(S+Bs) (the saving the flex
BlockMask gets on GPU). On CPU it runs torch's fused flash kernel over the context keys and
merges the per-block [Bs, Bs] part by log-sum-exp, forward and backward
(``_SplitContextAttention``): no score matrix is kept for the backward, and it is faster
than the dense mask at every anchor count measured (bench/attention_layout.py), so
``attention=auto`` uses it on CPU.
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
    """q [B, H, Q, D]; k, v [B, Hkv, S+Q, D] (context keys, then block keys) -> [B, H, Q, D].

    On CPU, torch's fused flash kernel attends to the context and the per-block part is
    merged into it through the log-sum-exp (``_SplitContextAttention``); elsewhere the scores
    are formed explicitly (``_blockwise_scores``)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # GQA: share each kv head across its query group
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if q.device.type != "cpu" or _flash_cpu is None or _flash_cpu_backward is None:
        return _blockwise_scores(q, k, v, mask)
    # One dtype for the fused kernel (under autocast the RMSNorm'd q/k stay fp32, v is bf16).
    q, k = q.to(v.dtype), k.to(v.dtype)
    s = mask.context_len
    return _SplitContextAttention.apply(q, k[:, :, :s], v[:, :, :s], k[:, :, s:], v[:, :, s:],
                                        mask.additive(v.dtype), mask.block_size)


def _blockwise_scores(q: Tensor, k: Tensor, v: Tensor, mask: BlockwiseMask) -> Tensor:
    """The blockwise attention with explicit [Q, S] scores (autograd keeps them)."""
    b, h, q_len, dim = q.shape
    s, bs = mask.context_len, mask.block_size
    n = q_len // bs
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


# torch's own CPU flash kernel behind SDPA (private ops; the explicit path if a build lacks them)
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_cpu_backward = getattr(torch.ops.aten,
                              "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _SplitContextAttention(torch.autograd.Function):
    """Softmax attention over the union of two key sets, the masked context and the query's
    own block, without a [Q, S+Q] score matrix: torch's fused CPU flash kernel attends to
    the context (returning its log-sum-exp), the [Bs, Bs] block scores are formed per block,
    and the two outputs are merged by their log-sum-exps.

    Backward (the split-KV identity of FlashAttention): the gradient of one key set's part
    is the flash backward of that part called with the *merged* output and log-sum-exp,
    because it recomputes the probabilities as exp(score - lse) and the softmax correction
    from rowsum(dO · O). So the context part reuses torch's fused backward; the block part
    is written out here. Equal to the dense-mask SDPA to float rounding (tests)."""

    @staticmethod
    def forward(ctx, q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor,
                ctx_mask: Tensor, block_size: int) -> Tensor:
        b, h, q_len, dim = q.shape
        n, bs = q_len // block_size, block_size
        scale = dim**-0.5
        # the block part and the merge (small tensors) in at least float32, the dtype of the
        # kernel's own log-sum-exp
        f32 = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast("cpu", enabled=False):
            o_ctx, lse_ctx = _flash_cpu(q, k_ctx, v_ctx, attn_mask=ctx_mask, scale=scale)
            # The kernel reports lse 0 (output 0) for a query that sees no context key.
            sees_ctx = (ctx_mask > float("-inf")).any(-1)  # [B, 1, Q]
            lse_ctx = lse_ctx.to(f32).masked_fill(~sees_ctx, float("-inf"))
            q_blk = q.reshape(b, h, n, bs, dim).to(f32)
            s_blk = q_blk @ k_blk.reshape(b, h, n, bs, dim).to(f32).transpose(-1, -2) * scale
            # [B, H, N, Bs, Bs]: a query sees its whole block
            lse = torch.logaddexp(lse_ctx, torch.logsumexp(s_blk, -1).view(b, h, q_len))
            p_blk = torch.exp(s_blk - lse.view(b, h, n, bs, 1))  # merged-softmax weights
            w_ctx = torch.exp(lse_ctx - lse).unsqueeze(-1)
            out = o_ctx.to(f32).masked_fill(~sees_ctx[..., None], 0.0) * w_ctx
            out = out + (p_blk @ v_blk.reshape(b, h, n, bs, dim).to(f32)).view(b, h, q_len, dim)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k_ctx, v_ctx, k_blk, v_blk, ctx_mask, out, lse, p_blk)
        ctx.block_size = block_size
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k_ctx, v_ctx, k_blk, v_blk, ctx_mask, out, lse, p_blk = ctx.saved_tensors
        b, h, q_len, dim = q.shape
        n, bs = q_len // ctx.block_size, ctx.block_size
        scale = dim**-0.5
        f32 = lse.dtype
        grad_out = grad_out.contiguous()
        with torch.autocast("cpu", enabled=False):
            dq, dk_ctx, dv_ctx = _flash_cpu_backward(grad_out, q, k_ctx, v_ctx, out, lse, 0.0,
                                                     False, attn_mask=ctx_mask, scale=scale)
            g = grad_out.to(f32).view(b, h, n, bs, dim)
            dv_blk = p_blk.transpose(-1, -2) @ g
            dp = g @ v_blk.reshape(b, h, n, bs, dim).to(f32).transpose(-1, -2)
            row = (grad_out.to(f32) * out.to(f32)).sum(-1).view(b, h, n, bs, 1)  # softmax term
            ds = p_blk * (dp - row) * scale
            dq_blk = (ds @ k_blk.reshape(b, h, n, bs, dim).to(f32)).view(b, h, q_len, dim)
            dk_blk = ds.transpose(-1, -2) @ q.reshape(b, h, n, bs, dim).to(f32)
        return (dq + dq_blk.to(dq.dtype), dk_ctx, dv_ctx, dk_blk.to(k_blk.dtype).view_as(k_blk),
                dv_blk.to(v_blk.dtype).view_as(v_blk), None, None)


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
