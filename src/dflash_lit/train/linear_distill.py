"""The frozen lm_head and the forward-KL distillation losses fused, chunk by chunk.

The composite (v3/v4) and ``distill`` with ``divergence=forward_kl`` need, per valid slot,
the drafter's full distribution at two temperatures and the target's distribution at one.
Run un-fused, that is the [B, N, Bs, V] drafter logits, the target's logits gathered to the
same shape, and half a dozen [M, V] log-softmaxes, exponentials and masks kept for autograd:
memory traffic, not arithmetic, sets the step time. Here ``chunk_rows`` valid slots at a
time go through logits → (CE, KL, argmax) → the gradient w.r.t. the hidden states, with the gradient written
by hand (``W`` is frozen):

    d[a·T²·KL(p_T ‖ q_T) + b·CE] / dz = a·T·(q_T − p_T) + b·(softmax(z) − onehot(y))

where ``z`` are the drafter's logits, ``q_T = softmax(z/T)`` and ``p_T = softmax(t/T)`` of
the target's logits ``t`` (-inf outside a cached top-k: those tokens have p = 0).
Each slot's weight (position decay, times the streak factor that needs the CE of the earlier
slots) scales its gradient row linearly, so the rows are scaled once every CE is known.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_lit.train.linear_ce import check_frozen_head, chunk_logits, outputs_on_grid
from dflash_lit.train.losses import CompositeLoss, DistillLoss, distill_slot_weights, valid_mask


class _LinearForwardKL(torch.autograd.Function):
    """Σ_i w_i·(a·T²·KL_i + b·CE_i) for rows h_i, gradient only w.r.t. h (W is frozen).

    ``weigh`` maps the detached per-row CE [M] to the normalised weights [M]."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, target: Tensor,
                rows_b: Tensor, rows_s: Tensor, weigh, div_weight: float, ce_weight: float,
                temperature: float, chunk_rows: int, compute_dtype: torch.dtype):
        m, t = hidden.shape[0], float(temperature)
        a, b = float(div_weight), float(ce_weight)
        ce = torch.empty(m, dtype=torch.float32, device=hidden.device)
        kl = torch.empty(m, dtype=torch.float32, device=hidden.device)
        pred = torch.empty(m, dtype=torch.long, device=hidden.device)
        grad = torch.empty_like(hidden)
        wc = weight.to(compute_dtype)
        # dtypes are set here, not by an enclosing autocast (which would run the KL's
        # Σ p·z dot products in bf16)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, m, chunk_rows):
                e = min(s + chunk_rows, m)
                z, y, top, pred[s:e], picked = chunk_logits(hidden[s:e], wc, labels[s:e],
                                                             compute_dtype)
                # the target at T: log p, and Σ p·log p with 0·log 0 = 0 (p = 0 off a top-k)
                log_p = torch.log_softmax(target[rows_b[s:e], rows_s[s:e]].float() / t, dim=-1)
                p = log_p.exp()
                neg_entropy = log_p.mul_(p).nan_to_num_(nan=0.0).sum(-1)
                # the drafter at T: KL = Σ p·log p − Σ p·z/T + logsumexp(z/T)  (Σ p = 1)
                q = (z - top[:, None]).div_(t).exp_()  # unnormalised softmax(z/T)
                total_t = q.sum(-1)
                lse_t = top / t + total_t.log()
                kl[s:e] = neg_entropy - torch.linalg.vecdot(p, z) / t + lse_t
                # d/dz = a·T·(q_T − p) + b·(softmax(z) − onehot), built in q's buffer
                if t == 1.0:  # softmax(z) is q_T
                    ce[s:e] = top + total_t.log() - picked
                    q.mul_(((a + b) / total_t)[:, None])
                else:
                    probs = z.sub_(top[:, None]).exp_()  # unnormalised softmax(z), in z's buffer
                    total = probs.sum(-1)
                    ce[s:e] = top + total.log() - picked
                    q.mul_((a * t / total_t)[:, None])
                    if b:
                        q.add_(probs.mul_((b / total)[:, None]))
                q.sub_(p.mul_(a * t))
                if b:
                    q.scatter_add_(1, y, torch.full_like(total_t, -b)[:, None])
                grad[s:e] = (q.to(compute_dtype) @ wc).to(hidden.dtype)
        kl.mul_(t * t)
        w = weigh(ce).float()
        grad.mul_(w[:, None].to(grad.dtype))
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(ce, kl, pred)
        return (w * (a * kl + b * ce)).sum(), ce, kl, pred

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_ce, _grad_kl, _grad_pred):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss.to(grad.dtype),) + (None,) * 11


def fused_forward_kl(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    target_logits: Tensor,
    target_positions: Tensor,
    gamma: float | None,
    div_weight: float,
    ce_weight: float,
    temperature: float,
    streak_aware: bool,
    chunk_rows: int = 2048,
    compute_dtype: torch.dtype | None = None,
):
    """``distill_loss(lm_head(hidden), labels, target, "forward_kl", ...)`` (and so the v3
    ``composite_loss``) without the [B, N, Bs, V] logits of either model.

    Args:
        hidden: [B, N, Bs, d] the drafter's final-normed states.
        weight: [V, d] the frozen lm_head (``requires_grad`` must be False).
        labels: [B, N, Bs] CE labels, -100 = ignore.
        target_logits: [B, S, V] the target's logits per position (-inf outside a cached
            top-k); slot (b, n, k) reads row ``target_positions[b, n, k]`` of sequence b.
        target_positions: [B, N, Bs] ``BlockLayout.target_positions()``.
        gamma, div_weight, ce_weight, temperature, streak_aware: as in ``distill_loss``.
        chunk_rows: valid slots per chunk (peak extra memory ~ 4 · chunk_rows · V floats).
        compute_dtype: lm_head matmul dtype (default: ``hidden``'s); the rest is float32.

    Returns:
        (``LossOutput`` with ``per_slot_kl``, the drafter's argmax per slot [B, N, Bs], -100
        where the slot is not valid).
    """
    check_frozen_head(weight, chunk_rows, where="fused_forward_kl")
    valid = valid_mask(labels)
    den: dict[str, Tensor] = {}  # the normaliser, known once every CE is

    def weigh(ce: Tensor) -> Tensor:
        w = distill_slot_weights(ce, valid, gamma, streak_aware)
        den["d"] = w.sum()
        return w / den["d"].clamp_min(torch.finfo(torch.float32).tiny)

    rows_b = torch.arange(labels.shape[0], device=labels.device)[:, None, None]
    rows_b = rows_b.expand(valid.shape)[valid]
    loss, ce, kl, pred_v = _LinearForwardKL.apply(
        hidden[valid], weight, labels[valid], target_logits.detach(), rows_b,
        target_positions[valid], weigh, div_weight, ce_weight, temperature, int(chunk_rows),
        compute_dtype or hidden.dtype)
    out, pred = outputs_on_grid(valid, loss, ce, pred_v, den["d"])
    out.per_slot_kl = torch.zeros(valid.shape, dtype=torch.float32, device=kl.device)
    out.per_slot_kl[valid] = kl
    return out, pred


def forward_kl_terms(loss: object) -> dict | None:
    """``fused_forward_kl``'s loss settings for a configured loss that it computes (the
    composite, ``distill`` with ``divergence=forward_kl``), else None."""
    if isinstance(loss, CompositeLoss):
        div_weight = loss.kl_weight
    elif isinstance(loss, DistillLoss) and loss.divergence == "forward_kl":
        div_weight = loss.div_weight
    else:
        return None
    return {"gamma": loss.gamma, "div_weight": div_weight, "ce_weight": loss.ce_weight,
            "temperature": loss.temperature, "streak_aware": loss.streak_aware}
