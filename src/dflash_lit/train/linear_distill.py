"""Forward-KL distillation (the v3 composite, ``distill`` with ``divergence=forward_kl``)
fused with the frozen lm_head, in the functional form of ``distill_loss``.

The chunk loop is ``linear_ce.fused_head_loss``; the per-row KL + CE and their gradient
written by hand are ``row_terms.forward_kl_terms``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_lit.train.linear_ce import fused_head_loss
from dflash_lit.train.losses import DistillLoss, LossOutput


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
) -> tuple[LossOutput, Tensor]:
    """``distill_loss(lm_head(hidden), labels, target, "forward_kl", ...)`` (and so the v3
    ``composite_loss``) without the [B, N, Bs, V] logits of either model.

    ``hidden`` [B, N, Bs, d]; ``weight`` [V, d] frozen; ``labels`` [B, N, Bs] CE labels;
    ``target_logits`` [B, S, V] per position, read at ``target_positions`` [B, N, Bs];
    the rest as in ``distill_loss``. Returns (``LossOutput`` with ``per_slot_kl``, the
    drafter's argmax per slot, -100 where the slot is not valid)."""
    loss = DistillLoss("forward_kl", gamma, div_weight, ce_weight, temperature, streak_aware,
                       labels="data")
    return fused_head_loss(loss, hidden, weight, labels, target_logits, target_positions,
                           chunk_rows, compute_dtype)
