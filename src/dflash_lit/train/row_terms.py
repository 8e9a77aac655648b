"""What a loss computes on one chunk of the frozen lm_head's logits in the fused path.

The fused path (``train/linear_ce.py``) never forms the [B, N, Bs, V] logits: it computes
``z = h @ W.T`` for a chunk of valid slots, asks the loss for each row's loss, CE (and
divergence) and ``d loss_row / dz``, and turns that into the gradient w.r.t. ``h`` at once.
``autograd_terms`` gets ``d loss_row / dz`` from any differentiable row loss; ``ce_terms``
and ``forward_kl_terms`` write it by hand, in place in the chunk's logits buffer (memory
traffic, not arithmetic, sets the step time there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class HeadChunk:
    """One chunk of valid slots. ``z`` may be overwritten by the terms computed from it."""

    z: Tensor  # [c, V] float32 drafter logits
    y: Tensor  # [c] int64 labels (CE)
    top: Tensor  # [c] row max of z
    picked: Tensor  # [c] z at the labels
    target: Tensor | None  # [c, V] the target's logits of the same positions, or None


@dataclass
class RowTerms:
    """Per-row results for a chunk, before the slot weights."""

    loss: Tensor  # [c] each row's loss (what the slot weights multiply)
    ce: Tensor  # [c] cross-entropy against the labels
    grad: Tensor  # [c, V] d loss / d z
    div: Tensor | None = None  # [c] the T²-scaled divergence, for losses that have one


RowLoss = Callable[[Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor, Tensor | None]]


def autograd_terms(row_loss: RowLoss, chunk: HeadChunk) -> RowTerms:
    """Terms of any row loss ``(z, y, target) -> (loss, ce, div)``, its gradient by autograd
    over the chunk alone (peak memory: a few [c, V] tensors)."""
    z = chunk.z.detach().requires_grad_(True)
    with torch.enable_grad():
        loss, ce, div = row_loss(z, chunk.y, chunk.target)
        (grad,) = torch.autograd.grad(loss.sum(), z)
    return RowTerms(loss.detach(), ce.detach(), grad, None if div is None else div.detach())


def ce_terms(chunk: HeadChunk) -> RowTerms:
    """CE and ``softmax(z) − onehot(y)``: four in-place passes over [c, V] (max was taken by
    the caller; sub+exp, sum, scale) and no temporary."""
    probs = chunk.z.sub_(chunk.top[:, None]).exp_()  # unnormalised softmax
    total = probs.sum(-1)
    ce = chunk.top + total.log() - chunk.picked
    probs.mul_(total.reciprocal()[:, None])
    probs.scatter_add_(1, chunk.y[:, None], torch.full_like(total, -1.0)[:, None])
    return RowTerms(ce, ce, probs)


def forward_kl_terms(chunk: HeadChunk, div_weight: float, ce_weight: float,
                     temperature: float) -> RowTerms:
    """``a·T²·KL(p_T‖q_T) + b·CE`` per row and its gradient

        d/dz = a·T·(q_T − p_T) + b·(softmax(z) − onehot(y)),

    ``q_T = softmax(z/T)``, ``p_T = softmax(target/T)`` (0 off a cached top-k), written in
    ``z``'s and a second [c, V] buffer."""
    z, t, a, b = chunk.z, float(temperature), float(div_weight), float(ce_weight)
    # the target at T: log p, and Σ p·log p with 0·log 0 = 0 (p = 0 off a top-k)
    log_p = torch.log_softmax(chunk.target.float() / t, dim=-1)
    p = log_p.exp()
    neg_entropy = log_p.mul_(p).nan_to_num_(nan=0.0).sum(-1)
    # the drafter at T: KL = Σ p·log p − Σ p·z/T + logsumexp(z/T)  (Σ p = 1)
    q = (z - chunk.top[:, None]).div_(t).exp_()  # unnormalised softmax(z/T)
    total_t = q.sum(-1)
    kl = neg_entropy - torch.linalg.vecdot(p, z) / t + chunk.top / t + total_t.log()
    if t == 1.0:  # softmax(z) is q_T
        ce = chunk.top + total_t.log() - chunk.picked
        q.mul_(((a + b) / total_t)[:, None])
    else:
        probs = z.sub_(chunk.top[:, None]).exp_()  # unnormalised softmax(z), in z's buffer
        total = probs.sum(-1)
        ce = chunk.top + total.log() - chunk.picked
        q.mul_((a * t / total_t)[:, None])
        if b:
            q.add_(probs.mul_((b / total)[:, None]))
    q.sub_(p.mul_(a * t))
    if b:
        q.scatter_add_(1, chunk.y[:, None], torch.full_like(total_t, -b)[:, None])
    kl = kl * (t * t)
    return RowTerms(a * kl + b * ce, ce, q, kl)
