"""Any drafter loss fused with the frozen lm_head, chunk by chunk.

``logits = hidden @ W.T`` over every slot of every block is the largest tensor of a DFlash
step (N·Bs·V floats per sequence: 512 anchors x 16 slots x 150k vocab is 1.2e9 floats), and
autograd keeps it, its log-softmax and their gradients alive until the backward. Here the
logits of ``chunk_rows`` valid slots at a time are computed, handed to the loss
(``DrafterLoss.row_terms``: each row's loss, CE, divergence and ``d loss / d logits``) and
turned into the gradient w.r.t. the hidden states right away — ``W`` is frozen, so only
``dL/dh = w · (d loss / d logits) @ W`` is needed, and it is ready at the end of the forward.
The slot weights (``DrafterLoss.slot_weights``) may depend on every slot's CE (streak-aware,
D-PACE); a row's gradient is linear in its weight, so the rows are scaled once the chunks
are done.

Peak extra memory: a few ``chunk_rows · V · 4 bytes`` buffers (one chunk's logits and what
the loss builds from them; a copy in ``compute_dtype`` when that is not float32) and
``M · d`` for the gradient, where M is the number of valid slots — independent of the number
of anchors. The un-fused path holds about ``4 · B · N · Bs · V · 4 bytes``.

Matmuls run in ``compute_dtype`` (bf16 on CPU is 2-4x faster than fp32 here); the softmax,
losses and reductions are float32, whatever an enclosing autocast says.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dflash_lit.model.layout import IGNORE
from dflash_lit.train.losses import (
    DPaceLoss,
    DrafterLoss,
    HardCELoss,
    LossOutput,
    require_target_logits,
    scatter_slots,
    valid_mask,
)
from dflash_lit.train.row_terms import HeadChunk, RowTerms, ce_terms

SlotWeights = Tensor | Callable[[Tensor], Tensor]
RowTermsFn = Callable[[HeadChunk], RowTerms]


def check_frozen_head(weight: Tensor, chunk_rows: int, where: str) -> None:
    """The fused losses compute only the input gradient: the head must be frozen."""
    if weight.requires_grad:
        raise ValueError(f"{where}: the lm_head weight must be frozen "
                         "(requires_grad=False); only the input gradient is computed")
    if chunk_rows < 1:
        raise ValueError(f"{where}: chunk_rows={chunk_rows} must be >= 1")


class _FusedHeadLoss(torch.autograd.Function):
    """``Σ_i w_i · loss_i(h_i @ W.T)``, gradient only w.r.t. ``h`` (W is frozen).

    ``terms`` computes a chunk's ``RowTerms``; ``weigh`` maps the detached CE of every row
    [M] to the normalised weights [M]. Returns (loss, CE [M], divergence [M] (0 without
    one), argmax [M])."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, target: Tensor | None,
                target_rows: tuple[Tensor, Tensor] | None, terms: RowTermsFn,
                weigh: Callable[[Tensor], Tensor], chunk_rows: int, compute_dtype: torch.dtype):
        m, dev = hidden.shape[0], hidden.device
        rows = torch.empty(m, dtype=torch.float32, device=dev)
        ce = torch.empty(m, dtype=torch.float32, device=dev)
        div = torch.zeros(m, dtype=torch.float32, device=dev)  # stays 0 without a divergence
        pred = torch.empty(m, dtype=torch.long, device=dev)
        grad = torch.empty_like(hidden)
        wc = weight.to(compute_dtype)
        # dtypes are set here, not by an enclosing autocast (which would run the losses'
        # reductions, e.g. the KL's Σ p·z dot products, in bf16)
        with torch.autocast(dev.type, enabled=False):
            for s in range(0, m, chunk_rows):
                e = min(s + chunk_rows, m)
                z = (hidden[s:e].to(compute_dtype) @ wc.T).float()
                y = labels[s:e]
                top, pred[s:e] = z.max(-1)
                tgt = None
                if target is not None:
                    b, p = target_rows
                    tgt = target[b[s:e], p[s:e]]
                t = terms(HeadChunk(z, y, top, z.gather(1, y[:, None]).squeeze(1), tgt))
                rows[s:e], ce[s:e] = t.loss, t.ce
                if t.div is not None:
                    div[s:e] = t.div
                grad[s:e] = (t.grad.to(compute_dtype) @ wc).to(hidden.dtype)
        w = weigh(ce).float()
        grad.mul_(w[:, None].to(grad.dtype))
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(ce, div, pred)
        return (w * rows).sum(), ce, div, pred

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_ce, _grad_div, _grad_pred):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss.to(grad.dtype),) + (None,) * 8


def fused_head_loss(
    loss: DrafterLoss,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    target_logits: Tensor | None = None,
    target_positions: Tensor | None = None,
    chunk_rows: int = 2048,
    compute_dtype: torch.dtype | None = None,
) -> tuple[LossOutput, Tensor]:
    """``loss.with_labels(lm_head(hidden), labels, target)`` without the [B, N, Bs, V] logits.

    Args:
        loss: a configured loss (``loss.fused`` must be True).
        hidden: [B, N, Bs, d] the drafter's final-normed states.
        weight: [V, d] the frozen lm_head (``requires_grad`` must be False).
        labels: [B, N, Bs] labels already resolved from ``loss.label_source``, -100 = ignore.
        target_logits: [B, S, V] the target's logits per position (-inf or
            ``OFF_TOPK_LOGIT`` outside a cached top-k); slot (b, n, k) reads row
            ``target_positions[b, n, k]`` of sequence b. Required when
            ``loss.needs_target_distribution``, unused otherwise.
        target_positions: [B, N, Bs] ``BlockLayout.target_positions()``.
        chunk_rows: valid slots per chunk.
        compute_dtype: lm_head matmul dtype (default: ``hidden``'s); the rest is float32.

    Returns:
        (``LossOutput``, the drafter's argmax per slot [B, N, Bs], -100 where the slot is not
        valid: all the training metrics need).
    """
    where = f"fused {type(loss).__name__}"
    check_frozen_head(weight, chunk_rows, where=where)
    if not loss.fused:
        raise ValueError(f"{where}: this loss runs on materialised logits only (fused=False)")
    valid = valid_mask(labels)
    target, rows = None, None
    if loss.needs_target_distribution:
        require_target_logits(target_logits, *loss.missing_target())
        b = torch.arange(labels.shape[0], device=labels.device)[:, None, None]
        target, rows = target_logits.detach(), (b.expand(valid.shape)[valid],
                                                target_positions[valid])
    den: dict[str, Tensor] = {}  # the normaliser, known once every CE is

    def weigh(ce: Tensor) -> Tensor:
        w, den["d"] = loss.slot_weights(ce, valid)
        return w / den["d"].clamp_min(torch.finfo(torch.float32).tiny)

    value, ce, div, pred_v = _FusedHeadLoss.apply(
        hidden[valid], weight, labels[valid], target, rows, loss.row_terms, weigh,
        int(chunk_rows), compute_dtype or hidden.dtype)
    pred = torch.full(valid.shape, IGNORE, dtype=torch.long, device=ce.device)
    pred[valid] = pred_v
    out = LossOutput(loss=value, per_slot_ce=scatter_slots(ce, valid),
                     weight_sum=den["d"].detach(), n_valid=valid.sum(),
                     per_slot_kl=scatter_slots(div, valid) if loss.needs_target_distribution
                     else None)
    return out, pred


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
        hidden: [M, d] rows to classify.
        weight: [V, d] frozen output projection (``requires_grad`` must be False).
        labels: [M] int64 class ids (no ignore entries: pass valid rows only).
        slot_weights: [M] float32 weights (already normalised by the caller), or a function
            of the per-row CE [M] (detached) returning them.
        chunk_rows: rows per chunk.
        compute_dtype: matmul dtype (default: ``hidden``'s); softmax/CE are float32.

    Returns:
        (loss scalar differentiable w.r.t. ``hidden``, per-row CE [M] float32, argmax [M]).
    """
    check_frozen_head(weight, chunk_rows, where="linear_cross_entropy")
    weigh = slot_weights if callable(slot_weights) else (lambda _ce: slot_weights)
    loss, ce, _div, pred = _FusedHeadLoss.apply(hidden, weight, labels, None, None, ce_terms,
                                                weigh, int(chunk_rows),
                                                compute_dtype or hidden.dtype)
    return loss, ce, pred


def restrict_vocab(weight: Tensor, labels: Tensor, vocab: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The rows of ``weight`` for ``vocab`` ∪ the valid labels' ids, ``labels`` renumbered into
    them, and those ids (sorted): a softmax over a reduced vocab that never drops a label."""
    valid = valid_mask(labels)
    ids = torch.unique(torch.cat([vocab, labels[valid]]))
    sub = torch.full_like(labels, IGNORE)  # slot 0 and ignored slots: no label
    sub[valid] = torch.searchsorted(ids, labels[valid])
    return weight[ids], sub, ids


def fused_hard_ce(hidden: Tensor, weight: Tensor, labels: Tensor, gamma: float | None,
                  chunk_rows: int = 2048, compute_dtype: torch.dtype | None = None
                  ) -> tuple[LossOutput, Tensor]:
    """``hard_ce_loss(hidden @ weight.T, labels, gamma)`` fused (``fused_head_loss``)."""
    return fused_head_loss(HardCELoss(gamma, labels="data"), hidden, weight, labels,
                           chunk_rows=chunk_rows, compute_dtype=compute_dtype)


def fused_dpace(hidden: Tensor, weight: Tensor, labels: Tensor, alpha: float,
                gamma: float | None, normalize: str, chunk_rows: int = 2048,
                compute_dtype: torch.dtype | None = None) -> tuple[LossOutput, Tensor]:
    """``dpace_loss(hidden @ weight.T, labels, ...)`` fused (``fused_head_loss``)."""
    return fused_head_loss(DPaceLoss(alpha, gamma, normalize, labels="data"), hidden, weight,
                           labels, chunk_rows=chunk_rows, compute_dtype=compute_dtype)
