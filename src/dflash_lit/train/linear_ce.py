"""The frozen lm_head and the position-weighted hard CE fused, chunk by chunk.

``logits = hidden @ W.T`` over every slot of every block is the largest tensor of a DFlash
step (N·Bs·V floats per sequence: 512 anchors x 16 slots x 150k vocab is 1.2e9 floats), and
autograd keeps it, its log-softmax and their gradients alive until the backward. Here the
logits of ``chunk_rows`` valid slots at a time are computed, reduced to (CE, argmax) and
turned into the gradient w.r.t. the hidden states right away — ``W`` is frozen, so only
``dL/dh = (softmax - onehot) · w @ W`` is needed, and it is ready at the end of the forward.

Peak extra memory: ``chunk_rows · V · 4 bytes`` (one chunk's logits, turned into their
gradient in place; plus a copy in ``compute_dtype`` when that is not float32) and ``M · d``
for the gradient, where M is the number of valid slots — independent of the number of
anchors. The un-fused path holds about
``4 · B · N · Bs · V · 4 bytes``.

Matmuls may run in a lower ``compute_dtype`` (bf16 on CPU is 2-4x faster than fp32 here);
the softmax, CE and reductions are always float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dflash_lit.model.layout import IGNORE
from dflash_lit.train.losses import (
    LossOutput,
    dpace_slot_weights,
    loss_normaliser,
    position_weights,
    valid_mask,
)

SlotWeights = Tensor | Callable[[Tensor], Tensor]


def check_frozen_head(weight: Tensor, chunk_rows: int, where: str) -> None:
    """The fused losses compute only the input gradient: the head must be frozen."""
    if weight.requires_grad:
        raise ValueError(f"{where}: the lm_head weight must be frozen "
                         "(requires_grad=False); only the input gradient is computed")
    if chunk_rows < 1:
        raise ValueError(f"{where}: chunk_rows={chunk_rows} must be >= 1")


def chunk_logits(hidden: Tensor, wc: Tensor, labels: Tensor, compute_dtype: torch.dtype
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One chunk's float32 logits [c, V] (matmul in ``compute_dtype``), its labels as [c, 1],
    row max [c], argmax [c] and the labels' logits [c]."""
    logits = (hidden.to(compute_dtype) @ wc.T).float()
    y = labels[:, None]
    top, arg = logits.max(-1)
    return logits, y, top, arg, logits.gather(1, y).squeeze(1)


class _LinearCE(torch.autograd.Function):
    """sum_i w_i · CE(h_i @ W.T, y_i), gradient only w.r.t. h (W is frozen).

    ``w`` is either fixed [M] weights, folded into each chunk's gradient, or a function of
    the detached CE [M] (D-PACE), applied once every row's CE is known: the gradient of row
    i is linear in w_i, so its rows are scaled afterwards."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, w: SlotWeights,
                chunk_rows: int, compute_dtype: torch.dtype):
        m = hidden.shape[0]
        ce = torch.empty(m, dtype=torch.float32, device=hidden.device)
        pred = torch.empty(m, dtype=torch.long, device=hidden.device)
        grad = torch.empty_like(hidden)
        wc = weight.to(compute_dtype)
        for s in range(0, m, chunk_rows):
            e = min(s + chunk_rows, m)
            # Four in-place passes over [c, V] (max+argmax, sub+exp, sum, scale) and no
            # temporary: logsumexp would allocate one and exponentiate a second time.
            logits, y, top, pred[s:e], picked = chunk_logits(hidden[s:e], wc, labels[s:e],
                                                              compute_dtype)
            probs = logits.sub_(top[:, None]).exp_()  # unnormalised softmax
            total = probs.sum(-1)
            ce[s:e] = top + total.log() - picked
            # d(w·CE)/dlogits = w · (softmax - onehot), written into the logits buffer
            w_rows = torch.ones_like(total) if callable(w) else w[s:e]
            probs.mul_((w_rows / total)[:, None])
            probs.scatter_add_(1, y, w_rows.neg()[:, None])
            grad[s:e] = (probs.to(compute_dtype) @ wc).to(hidden.dtype)
        if callable(w):
            w = w(ce).float()
            grad.mul_(w[:, None])
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(ce, pred)
        return (w * ce).sum(), ce, pred

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_ce, _grad_pred):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    slot_weights: SlotWeights,
    chunk_rows: int = 2048,
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``Σ_i slot_weights_i · CE(hidden_i @ weight.T, labels_i)`` without materialising logits.

    Args:
        hidden: [M, d] rows to classify (the drafter's final-normed states of valid slots).
        weight: [V, d] frozen output projection (``requires_grad`` must be False).
        labels: [M] int64 class ids (no ignore entries: pass valid rows only).
        slot_weights: [M] float32 weights (already normalised by the caller), or a function
            of the per-row CE [M] (detached) returning them, for weights that depend on it.
        chunk_rows: rows per chunk (peak memory ~ 3 · chunk_rows · V floats).
        compute_dtype: matmul dtype (default: ``hidden``'s); softmax/CE are float32.

    Returns:
        (loss scalar differentiable w.r.t. ``hidden``, per-row CE [M] float32, argmax [M]).
    """
    check_frozen_head(weight, chunk_rows, where="linear_cross_entropy")
    cd = compute_dtype or hidden.dtype
    w = slot_weights if callable(slot_weights) else slot_weights.float()
    return _LinearCE.apply(hidden, weight, labels, w, int(chunk_rows), cd)


def restrict_vocab(weight: Tensor, labels: Tensor, vocab: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The rows of ``weight`` for ``vocab`` ∪ the valid labels' ids, ``labels`` renumbered into
    them, and those ids (sorted): a softmax over a reduced vocab that never drops a label."""
    valid = valid_mask(labels)
    ids = torch.unique(torch.cat([vocab, labels[valid]]))
    sub = torch.full_like(labels, IGNORE)  # slot 0 and ignored slots: no label
    sub[valid] = torch.searchsorted(ids, labels[valid])
    return weight[ids], sub, ids


def fused_hard_ce(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    gamma: float | None,
    chunk_rows: int = 2048,
    compute_dtype: torch.dtype | None = None,
) -> tuple[LossOutput, Tensor]:
    """The ``hard_ce_loss`` of ``hidden @ weight.T`` without the [B, N, Bs, V] logits.

    ``hidden`` [B, N, Bs, d], ``labels`` [B, N, Bs] (-100 = ignore). Returns the same
    ``LossOutput`` as ``hard_ce_loss(lm_head(hidden), labels, gamma)`` and the drafter's
    argmax per slot [B, N, Bs] (-100 where the slot is not valid), which is all the training
    metrics need.
    """
    valid = valid_mask(labels)
    w_pos = position_weights(labels.shape[-1], gamma, device=hidden.device)
    w = w_pos.expand(valid.shape)[valid]
    weight_sum = w.sum()
    w_norm = w / weight_sum.clamp_min(torch.finfo(torch.float32).tiny)
    loss, ce, pred_v = linear_cross_entropy(
        hidden[valid], weight, labels[valid], w_norm, chunk_rows, compute_dtype
    )
    return outputs_on_grid(valid, loss, ce, pred_v, weight_sum)


def fused_dpace(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    alpha: float,
    gamma: float | None,
    normalize: str,
    chunk_rows: int = 2048,
    compute_dtype: torch.dtype | None = None,
) -> tuple[LossOutput, Tensor]:
    """The ``dpace_loss`` of ``hidden @ weight.T`` without the [B, N, Bs, V] logits.

    One pass: the D-PACE weights need every slot's CE, which the fused forward has once its
    chunks are done; the gradient rows are then scaled by them. Same returns as
    ``fused_hard_ce``.
    """
    valid = valid_mask(labels)
    den: dict[str, Tensor] = {}  # the normaliser, known once the forward has every CE

    def weigh(ce: Tensor) -> Tensor:
        w = dpace_slot_weights(ce, valid, alpha, gamma)
        den["d"] = loss_normaliser(w, normalize)
        return w / den["d"].clamp_min(torch.finfo(torch.float32).tiny)

    loss, ce, pred_v = linear_cross_entropy(
        hidden[valid], weight, labels[valid], weigh, chunk_rows, compute_dtype
    )
    return outputs_on_grid(valid, loss, ce, pred_v, den["d"])


def outputs_on_grid(valid: Tensor, loss: Tensor, ce: Tensor, pred_v: Tensor,
             weight_sum: Tensor) -> tuple[LossOutput, Tensor]:
    """The fused losses' returns: per-slot CE and argmax put back on the [B, N, Bs] grid."""
    per_slot = torch.zeros(valid.shape, dtype=torch.float32, device=ce.device)
    per_slot[valid] = ce
    pred = torch.full(valid.shape, IGNORE, dtype=torch.long, device=ce.device)
    pred[valid] = pred_v
    return LossOutput(loss=loss, per_slot_ce=per_slot, weight_sum=weight_sum.detach(),
                      n_valid=valid.sum()), pred
