"""Drafter losses: position-weighted hard CE, D-PACE, and distillation against the target
(the v3 composite, forward/reverse KL, JSD, total variation, CE + divergence mixes).

Tensor conventions (shared with the LightningModule and the metrics):

- ``logits``        [B, N, Bs, V]  drafter logits, N blocks of Bs slots per sequence.
- ``labels``        [B, N, Bs]     LongTensor, ``IGNORE`` (-100) where invalid. Slot 0
  (the given anchor token) is ignored whatever its label says.
- ``target_logits`` [B, N, Bs, V]  the target's logits for the same predicted positions
  (slot k predicts position a+k, so ``target_logits[..., k, :]`` is the target's output at
  position a+k-1), or None when the loss does not need them.

Everything heavy is computed on the valid slots only (gathered first), in float32 whatever the
logits' dtype: with V ~ 150k a log-softmax over invalid/padding slots would dominate memory.
No function here synchronises with the device (no ``.item()``), so they are safe inside a
compiled / CUDA-graph-free training step.

Reduction: every loss is ``Σ_valid w·ℓ / Σ_valid d`` over the batch it is given (``d = w``,
or ``d = 1`` for D-PACE with ``normalize=slots``), and each slot's ``w`` depends only on its
own block, so two halves of a batch combine exactly as ``(L_a·W_a + L_b·W_b) / (W_a + W_b)``
with ``W = LossOutput.weight_sum`` (value and gradient). The module hands each rank's batch
to the loss on its own and DDP averages the ranks' gradients, so a multi-rank step optimises
the mean of per-rank ratios; it equals the global ratio when the ranks' ``W`` are equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_lit.errors import UserError
from dflash_lit.model.layout import IGNORE

LabelSource = Literal["data", "target_argmax"]
_LABEL_SOURCES: tuple[str, ...] = ("data", "target_argmax")
Divergence = Literal["forward_kl", "reverse_kl", "jsd", "tv"]
DIVERGENCES: tuple[str, ...] = ("forward_kl", "reverse_kl", "jsd", "tv")
Normalize = Literal["weights", "slots"]
_NORMALIZE: tuple[str, ...] = ("weights", "slots")
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class LossOutput:
    """What a drafter loss returns.

    Attributes:
        loss: scalar, differentiable, float32: the weighted mean over valid slots.
        per_slot_ce: [B, N, Bs] float32, detached: CE of each slot (0 at invalid slots).
        weight_sum: scalar float32, detached: the normaliser Σ weight over valid slots
            (Σ w for hard CE, Σ w·s for the streak-aware composite, Σ w or the valid-slot
            count for D-PACE). ``loss * weight_sum``
            is the un-normalised sum, so batch losses combine exactly as
            Σ loss_i·W_i / Σ W_i (what ``DrafterMetrics`` does).
        n_valid: scalar int64: number of valid slots (slot >= 1, label != -100).
        per_slot_kl: [B, N, Bs] float32, detached, T²-scaled divergence per slot (the
            distillation losses only: KL for composite, ``loss.divergence`` for distill).
    """

    loss: Tensor
    per_slot_ce: Tensor
    weight_sum: Tensor
    n_valid: Tensor
    per_slot_kl: Tensor | None = None


class DrafterLoss(Protocol):
    """A configured loss: ``loss_fn(logits, labels, target_logits) -> LossOutput``."""

    needs_target_logits: bool
    needs_target_distribution: bool  # full logits online, top-k from a feature cache
    needs_full_distribution: bool  # full logits only: a top-k cache is refused
    label_source: str

    def __call__(
        self, logits: Tensor, labels: Tensor, target_logits: Tensor | None = None
    ) -> LossOutput: ...


# --------------------------------------------------------------------------- helpers
def position_weights(
    block_size: int, gamma: float | None, device: torch.device | str | None = None
) -> Tensor:
    """Per-slot weights [Bs] (float32): ``w_0 = 0``, ``w_k = exp(-(k-1)/gamma)`` for k >= 1.

    ``gamma=None`` means no decay (``w_k = 1`` for k >= 1, as SpecForge with γ unset).
    ``gamma`` must otherwise be a finite or infinite number > 0; ``math.inf`` is the same as
    None. Raises ValueError naming ``loss.gamma`` for gamma <= 0 / NaN.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(
            f"block_size={block_size!r}: a block needs the anchor slot plus at least one "
            "predicted slot (drafter.block_size >= 2)"
        )
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    if gamma is None or (isinstance(gamma, (int, float)) and math.isinf(gamma) and gamma > 0):
        w = torch.ones(block_size, device=device, dtype=torch.float32)
    else:
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma > 0:
            raise ValueError(
                f"loss.gamma={gamma!r}: the position-decay constant must be > 0 "
                "(w_k = exp(-(k-1)/gamma)); use null for no decay. Public recipes use "
                "7 for block_size 16, 5 for 10, 4 for 8."
            )
        w = torch.exp(-(k - 1.0) / float(gamma))
    w[0] = 0.0  # slot 0 is the given anchor token: never a prediction
    return w


def check_block_inputs(
    logits: Tensor, labels: Tensor, target_logits: Tensor | None = None, where: str = "loss"
) -> None:
    if logits.dim() != 4:
        raise ValueError(f"{where}: logits must be [B, N, Bs, V], got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:3]:
        raise ValueError(
            f"{where}: labels shape {tuple(labels.shape)} must equal logits.shape[:3] = "
            f"{tuple(logits.shape[:3])} ([B, N, Bs])"
        )
    if labels.dtype != torch.long:
        raise TypeError(f"{where}: labels must be int64 (LongTensor), got {labels.dtype}")
    if logits.shape[2] < 2:
        raise ValueError(
            f"{where}: block size (logits.shape[2]) must be >= 2, got {logits.shape[2]}"
        )
    if target_logits is not None and target_logits.shape != logits.shape:
        raise ValueError(
            f"{where}: target_logits shape {tuple(target_logits.shape)} must equal logits shape "
            f"{tuple(logits.shape)} (the target's logits for the same predicted positions)"
        )


def valid_mask(labels: Tensor) -> Tensor:
    """[B, N, Bs] bool: slots that are predictions with a label (slot >= 1, label != -100)."""
    valid = labels != IGNORE
    valid[..., 0] = False
    return valid


def require_target_logits(target_logits: Tensor | None, what: str, instead: str,
                          why: str = "") -> None:
    """ValueError naming the config value that needs the target's logits when there are none."""
    if target_logits is None:
        raise ValueError(f"{what} needs the target's logits{why}, but target_logits is None: "
                         f"have the module compute them, or {instead}")


def target_argmax_labels(target_logits: Tensor, labels: Tensor) -> Tensor:
    """Replace every valid label with the target's greedy choice, keeping the -100s.

    ``target_logits[..., k, :]`` is the target's output at position a+k-1, so its argmax is
    what greedy verification accepts at position a+k. Slot 0 and -100 entries stay -100.
    """
    require_target_logits(target_logits, "loss.labels=target_argmax", "set loss.labels=data")
    if target_logits.shape[:3] != labels.shape or target_logits.dim() != 4:
        raise ValueError(
            f"target_argmax_labels: target_logits {tuple(target_logits.shape)} must be "
            f"[B, N, Bs, V] with [B, N, Bs] = labels shape {tuple(labels.shape)}"
        )
    return resolve_argmax_labels(target_logits.argmax(-1), labels)


def resolve_argmax_labels(argmax_per_slot: Tensor, labels: Tensor) -> Tensor:
    """Labels = the target's greedy ids [B, N, Bs] at every valid slot; -100 elsewhere.

    The same labels as ``target_argmax_labels`` from ids alone (a cache stores ids, not
    logits)."""
    return torch.where(valid_mask(labels), argmax_per_slot.to(labels.dtype),
                       torch.full_like(labels, IGNORE))


def _scatter_slots(values: Tensor, valid: Tensor) -> Tensor:
    """Put per-valid-slot values [M] back into a zero [B, N, Bs] float32 tensor."""
    out = torch.zeros(valid.shape, dtype=torch.float32, device=values.device)
    out[valid] = values.detach().float()
    return out


# --------------------------------------------------------------------------- losses
def hard_ce_loss(logits: Tensor, labels: Tensor, gamma: float | None = 7.0) -> LossOutput:
    """Position-weighted cross-entropy against hard labels.

    ``loss = Σ_valid w_k · CE_k / Σ_valid w_k`` with ``w_k = exp(-(k-1)/gamma)``: a weighted
    mean over valid slots (slot >= 1 with a label). Computed in float32 on the valid slots
    only. With no valid slot the loss is an exact 0 that is still attached to the graph.
    Pass ``target_argmax_labels(target_logits, labels)`` as ``labels`` for the target's greedy
    labels.
    """
    check_block_inputs(logits, labels, where="hard_ce_loss")
    bs = logits.shape[2]
    valid = valid_mask(labels)
    w_pos = position_weights(bs, gamma, device=logits.device)
    ce = F.cross_entropy(logits[valid].float(), labels[valid], reduction="none")  # [M]
    w = w_pos.expand(valid.shape)[valid]  # [M]
    weight_sum = w.sum()
    # clamp: an all-invalid batch gives 0/tiny = 0 instead of NaN, with no host sync.
    loss = (w * ce).sum() / weight_sum.clamp_min(torch.finfo(torch.float32).tiny)
    return LossOutput(
        loss=loss,
        per_slot_ce=_scatter_slots(ce, valid),
        weight_sum=weight_sum.detach(),
        n_valid=valid.sum(),
    )


def streak_weights(log_p_label: Tensor, valid: Tensor) -> Tensor:
    """Detached streak factors s [B, N, Bs]: ``s_k = Π_{1<=j<k} p_draft(label_j)``, s_1 = 1.

    ``log_p_label`` [B, N, Bs] holds log p_draft(label) at valid slots (anything elsewhere).
    An invalid slot j inside a block contributes a factor 1 (it is not a prediction the
    draft can get wrong); slot 0 always contributes 1. Computed in log space (exclusive
    cumulative sum) so long blocks underflow gracefully to 0.
    """
    lp = torch.where(
        valid, log_p_label.detach().float(), torch.zeros_like(log_p_label, dtype=torch.float32)
    )
    exclusive = torch.cumsum(lp, dim=-1) - lp
    return torch.exp(exclusive)


def distill_slot_weights(ce: Tensor, valid: Tensor, gamma: float | None,
                         streak_aware: bool) -> Tensor:
    """[M] detached weights of the valid slots of a distillation loss: the position decay
    ``w_γ(k)``, times the streak factor (``streak_weights`` of ``p = exp(-CE)``) if
    ``streak_aware``. ``ce`` [M] is the valid slots' CE, in ``valid``'s [B, N, Bs] order."""
    w = position_weights(valid.shape[-1], gamma, device=ce.device).expand(valid.shape)
    if streak_aware:
        log_p_label = torch.zeros(valid.shape, dtype=torch.float32, device=ce.device)
        log_p_label[valid] = -ce.detach().float()
        w = w * streak_weights(log_p_label, valid)
    return w[valid]


# --------------------------------------------------------------------------- D-PACE
def dpace_weights(ce: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """Detached D-PACE weights [B, N, Bs] from the per-slot CE [B, N, Bs] (any value where
    ``valid`` is False).

    D-PACE (Dynamic Position-Aware Cross-Entropy, arXiv:2605.18810): the draft's confidence
    in a slot's label is ``q_k = exp(-CE_k)``, smoothed towards 1 as
    ``q̃_k = (1-alpha)·q_k + alpha``. ``C_m = Π_{i<=m} q̃_i`` (within the block) estimates the
    probability that slots 1..m are all accepted, so ``Σ_m C_m`` is the block's expected
    accepted length, and slot k's weight is the part of it that slot k gates:
    ``w_k = Σ_{m>=k} C_m`` (for alpha = 0, the derivative of that sum w.r.t. ``log q_k``, so
    ``Σ w·CE`` follows the expected accepted length's gradient). Invalid slots
    (slot 0, ignore labels) are a factor 1 in the products, are left out of the sums and get
    weight 0.
    """
    q = torch.exp(-ce.detach().float())
    smooth = torch.where(valid, (1.0 - alpha) * q + alpha, torch.ones_like(q))
    cum = torch.cumprod(smooth, dim=-1) * valid
    # suffix sum Σ_{m>=k} C_m = (Σ_m C_m) - (Σ_{m<k} C_m)
    suffix = cum.sum(dim=-1, keepdim=True) - (torch.cumsum(cum, dim=-1) - cum)
    return suffix * valid


def dpace_slot_weights(
    ce: Tensor, valid: Tensor, alpha: float, gamma: float | None
) -> Tensor:
    """[M] detached weights of the valid slots: D-PACE times the position decay ``w_γ(k)``.

    ``ce`` [M] is the CE of the valid slots (in ``valid``'s [B, N, Bs] order). ``gamma=None``
    leaves D-PACE alone, as the public trainers use it.
    """
    full = torch.zeros(valid.shape, dtype=torch.float32, device=ce.device)
    full[valid] = ce.detach().float()
    w = dpace_weights(full, valid, alpha)
    if gamma is not None:
        w = w * position_weights(valid.shape[-1], gamma, device=ce.device)
    return w[valid]


def loss_normaliser(w: Tensor, normalize: str) -> Tensor:
    """The denominator of a D-PACE loss: ``Σ w`` (``weights``) or the valid-slot count
    (``slots``), a float32 scalar either way."""
    return w.sum() if normalize == "weights" else torch.tensor(
        float(w.numel()), dtype=torch.float32, device=w.device)


def dpace_loss(
    logits: Tensor,
    labels: Tensor,
    alpha: float = 0.5,
    gamma: float | None = None,
    normalize: Normalize = "weights",
) -> LossOutput:
    """CE weighted by the detached D-PACE weights (``dpace_weights``), times ``w_γ(k)`` if
    ``gamma`` is set: ``loss = Σ_valid w·CE / D`` with ``D = Σ_valid w`` (``weights``) or the
    number of valid slots (``slots``).
    """
    check_block_inputs(logits, labels, where="dpace_loss")
    _check_dpace_args(alpha, normalize)
    valid = valid_mask(labels)
    ce = F.cross_entropy(logits[valid].float(), labels[valid], reduction="none")  # [M]
    w = dpace_slot_weights(ce, valid, alpha, gamma)
    den = loss_normaliser(w, normalize)
    loss = (w * ce).sum() / den.clamp_min(_TINY)
    return LossOutput(loss=loss, per_slot_ce=_scatter_slots(ce, valid),
                      weight_sum=den.detach(), n_valid=valid.sum())


def _check_dpace_args(alpha: float, normalize: str) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise UserError(f"loss.alpha={alpha!r}: the D-PACE confidence smoothing must be in "
                        "[0, 1] (public recipes use 0.5)")
    if normalize not in _NORMALIZE:
        raise UserError(f"loss.normalize={normalize!r}: must be one of {list(_NORMALIZE)} "
                        "('weights': Σ w·CE / Σ w; 'slots': Σ w·CE / valid slots)")


# --------------------------------------------------------------------------- distillation
def _plogp_ratio(log_a: Tensor, log_b: Tensor) -> Tensor:
    """Σ_v a_v·(log a_v − log b_v) per row, with 0·log 0 = 0 (a target logit of -inf)."""
    term = log_a.exp() * (log_a - log_b)
    return torch.where(torch.isneginf(log_a), torch.zeros_like(term), term).sum(-1)


def slot_divergence(log_q: Tensor, log_p: Tensor, divergence: str) -> Tensor:
    """[M] divergence between the target's ``p`` and the draft's ``q``, from log-probs [M, V].

    ``forward_kl`` KL(p‖q) (mass-covering); ``reverse_kl`` KL(q‖p) (mode-seeking, infinite
    where q has mass p lacks); ``jsd`` ½KL(p‖m) + ½KL(q‖m), m = (p+q)/2 (bounded by ln 2);
    ``tv`` ½Σ|p − q| (in [0, 1]).
    """
    if divergence == "forward_kl":
        return _plogp_ratio(log_p, log_q)
    if divergence == "reverse_kl":
        return _plogp_ratio(log_q, log_p)
    if divergence == "jsd":
        log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
        return 0.5 * (_plogp_ratio(log_p, log_m) + _plogp_ratio(log_q, log_m))
    if divergence == "tv":
        return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    raise UserError(f"loss.divergence={divergence!r}: must be one of {list(DIVERGENCES)}")


def distill_loss(
    logits: Tensor,
    labels: Tensor,
    target_logits: Tensor | None,
    divergence: Divergence = "forward_kl",
    gamma: float | None = 7.0,
    div_weight: float = 1.0,
    ce_weight: float = 0.0,
    temperature: float = 1.0,
    streak_aware: bool = False,
) -> LossOutput:
    """``div_weight·T²·D(target, draft at T) + ce_weight·CE(labels)`` per slot, weighted mean.

    - ``D`` is ``slot_divergence`` between ``softmax(target/T)`` and ``softmax(draft/T)``,
      scaled by ``T²`` (Hinton et al.'s convention: the KL gradient's size then does not
      shrink with T, so the weights mean the same at any temperature).
    - CE is plain (T = 1) cross-entropy against ``labels``.
    - Weights ``w_k · s_k``: position decay times, if ``streak_aware``, the detached draft
      probability (T = 1) that slots 1..k-1 were all right (``streak_weights``).
    - Normalised by ``Σ w·s`` over valid slots.
    """
    check_block_inputs(logits, labels, target_logits, where="distill_loss")
    require_target_logits(target_logits, f"loss.divergence={divergence}",
                          "use loss.name=hard_ce / dpace")
    _check_distill_args(divergence, div_weight, ce_weight, temperature)
    valid = valid_mask(labels)
    t = float(temperature)

    draft = logits[valid].float()  # [M, V]
    ce = F.cross_entropy(draft, labels[valid], reduction="none")  # [M]
    log_q_t = F.log_softmax(draft / t, dim=-1)
    log_p_t = F.log_softmax(target_logits[valid].detach().float() / t, dim=-1)
    div = slot_divergence(log_q_t, log_p_t, divergence) * (t * t)  # [M]

    w = distill_slot_weights(ce, valid, gamma, streak_aware)  # [M]
    weight_sum = w.sum()
    loss = (w * (div_weight * div + ce_weight * ce)).sum() / weight_sum.clamp_min(_TINY)
    return LossOutput(
        loss=loss,
        per_slot_ce=_scatter_slots(ce, valid),
        weight_sum=weight_sum.detach(),
        n_valid=valid.sum(),
        per_slot_kl=_scatter_slots(div, valid),
    )


def composite_loss(
    logits: Tensor,
    labels: Tensor,
    target_logits: Tensor | None,
    gamma: float | None = 10.0,
    kl_weight: float = 0.7,
    ce_weight: float = 0.3,
    temperature: float = 2.0,
    streak_aware: bool = True,
) -> LossOutput:
    """The v3 recipe: ``kl_weight·T²·KL(target‖draft at T) + ce_weight·CE(labels)`` per slot,
    with streak-aware position weights: ``distill_loss`` with ``divergence=forward_kl``."""
    check_block_inputs(logits, labels, target_logits, where="composite_loss")
    require_target_logits(target_logits, "loss.name=composite", "use loss.name=hard_ce",
                          " (its KL term)")
    _check_mix_args(kl_weight, ce_weight, temperature, div_key="kl_weight", example="0.7 / 0.3")
    return distill_loss(logits, labels, target_logits, "forward_kl", gamma, kl_weight,
                        ce_weight, temperature, streak_aware)


def _check_mix_args(div_weight: float, ce_weight: float, temperature: float,
                    div_key: str, example: str) -> None:
    if not temperature > 0:
        raise UserError(f"loss.temperature={temperature!r}: must be > 0 (v3 uses 2.0)")
    if div_weight < 0 or ce_weight < 0 or (div_weight == 0 and ce_weight == 0):
        raise UserError(
            f"loss.{div_key}={div_weight!r}, loss.ce_weight={ce_weight!r}: both must be >= 0 "
            f"and not both 0 (e.g. {example})"
        )


def _check_distill_args(divergence: str, div_weight: float, ce_weight: float,
                        temperature: float) -> None:
    if divergence not in DIVERGENCES:
        raise UserError(f"loss.divergence={divergence!r}: must be one of {list(DIVERGENCES)}")
    _check_mix_args(div_weight, ce_weight, temperature, div_key="div_weight",
                    example="1.0 / 0.0 for a pure divergence")


def _check_gamma(gamma: float | None) -> None:
    """``loss.gamma`` at config time, as a ``UserError``."""
    try:
        position_weights(2, gamma)
    except ValueError as e:
        raise UserError(str(e)) from None


def _check_label_source(labels: str) -> None:
    if labels not in _LABEL_SOURCES:
        raise UserError(
            f"loss.labels={labels!r}: must be one of {list(_LABEL_SOURCES)} ('data': the "
            "sequence's tokens; 'target_argmax': the target's greedy choice)"
        )


def _resolve_labels(source: str, labels: Tensor, target_logits: Tensor | None) -> Tensor:
    return target_argmax_labels(target_logits, labels) if source == "target_argmax" else labels


# --------------------------------------------------------------------------- configured callables
class _LabelledLoss:
    """What every configured loss shares: its CE labels come from ``labels`` (data /
    target_argmax), resolved before ``with_labels`` (which subclasses define) runs."""

    labels: LabelSource

    @property
    def label_source(self) -> str:
        return self.labels

    def with_labels(self, logits: Tensor, labels: Tensor,
                    target_logits: Tensor | None = None) -> LossOutput:
        raise NotImplementedError

    def __call__(
        self, logits: Tensor, labels: Tensor, target_logits: Tensor | None = None
    ) -> LossOutput:
        return self.with_labels(logits, _resolve_labels(self.labels, labels, target_logits),
                                target_logits)


class _HardLabelLoss(_LabelledLoss):
    """Losses on hard labels only: the target's argmax ids suffice (a feature cache stores them)."""

    needs_target_distribution = False
    needs_full_distribution = False

    @property
    def needs_target_logits(self) -> bool:
        """Whether the module must compute the target's logits (here: for their argmax)."""
        return self.labels == "target_argmax"


@dataclass(frozen=True)
class HardCELoss(_HardLabelLoss):
    """``hard_ce`` configured: position-weighted CE against ``labels`` (data / target_argmax)."""

    gamma: float | None = 7.0
    labels: LabelSource = "target_argmax"

    def __post_init__(self) -> None:
        _check_label_source(self.labels)
        _check_gamma(self.gamma)

    def with_labels(self, logits: Tensor, labels: Tensor,
                    target_logits: Tensor | None = None) -> LossOutput:
        """The loss for labels already resolved from ``label_source``."""
        return hard_ce_loss(logits, labels, self.gamma)


@dataclass(frozen=True)
class CompositeLoss(_LabelledLoss):
    """``composite`` configured (v3): KL(target‖draft, T)·T²·kl_weight + CE·ce_weight."""

    gamma: float | None = 10.0
    kl_weight: float = 0.7
    ce_weight: float = 0.3
    temperature: float = 2.0
    streak_aware: bool = True
    labels: LabelSource = "data"  # CE labels; v3 used the data tokens

    def __post_init__(self) -> None:
        _check_label_source(self.labels)
        _check_mix_args(self.kl_weight, self.ce_weight, self.temperature, div_key="kl_weight",
                        example="0.7 / 0.3")
        _check_gamma(self.gamma)

    @property
    def needs_target_logits(self) -> bool:
        """Always True: the KL term needs the target's logits."""
        return True

    needs_target_distribution = True  # the KL term: full logits online, top-k from a cache
    needs_full_distribution = False

    def with_labels(self, logits: Tensor, labels: Tensor,
                    target_logits: Tensor | None = None) -> LossOutput:
        """The loss for CE labels already resolved from ``label_source``."""
        return composite_loss(
            logits,
            labels,
            target_logits,
            gamma=self.gamma,
            kl_weight=self.kl_weight,
            ce_weight=self.ce_weight,
            temperature=self.temperature,
            streak_aware=self.streak_aware,
        )


@dataclass(frozen=True)
class DPaceLoss(_HardLabelLoss):
    """``dpace`` configured: CE against ``labels`` weighted by D-PACE (times ``w_γ`` if set)."""

    alpha: float = 0.5
    gamma: float | None = None
    normalize: Normalize = "weights"
    labels: LabelSource = "target_argmax"

    def __post_init__(self) -> None:
        _check_label_source(self.labels)
        _check_dpace_args(self.alpha, self.normalize)
        _check_gamma(self.gamma)

    def with_labels(self, logits: Tensor, labels: Tensor,
                    target_logits: Tensor | None = None) -> LossOutput:
        """The loss for labels already resolved from ``label_source``."""
        return dpace_loss(logits, labels, self.alpha, self.gamma, self.normalize)


@dataclass(frozen=True)
class DistillLoss(_LabelledLoss):
    """``distill`` configured: ``div_weight·T²·D(target, draft) + ce_weight·CE`` per slot,
    D = ``divergence`` (forward_kl | reverse_kl | jsd | tv)."""

    divergence: Divergence = "forward_kl"
    gamma: float | None = 7.0
    div_weight: float = 1.0
    ce_weight: float = 0.0
    temperature: float = 1.0
    streak_aware: bool = False
    labels: LabelSource = "target_argmax"  # CE labels (and the training metrics' labels)

    def __post_init__(self) -> None:
        _check_label_source(self.labels)
        _check_distill_args(self.divergence, self.div_weight, self.ce_weight, self.temperature)
        _check_gamma(self.gamma)

    needs_target_logits = True  # the divergence needs the target's distribution

    needs_target_distribution = True  # full logits online, top-k from a cache

    @property
    def needs_full_distribution(self) -> bool:
        """reverse KL is infinite wherever the draft has mass outside a cached top-k."""
        return self.divergence == "reverse_kl"

    def with_labels(self, logits: Tensor, labels: Tensor,
                    target_logits: Tensor | None = None) -> LossOutput:
        """The loss for CE labels already resolved from ``label_source``."""
        return distill_loss(logits, labels, target_logits, self.divergence, self.gamma,
                            self.div_weight, self.ce_weight, self.temperature,
                            self.streak_aware)


LOSSES: dict[str, type] = {"hard_ce": HardCELoss, "composite": CompositeLoss,
                           "dpace": DPaceLoss, "distill": DistillLoss}


def build_loss(name: str, **kwargs: Any) -> DrafterLoss:
    """Build a configured loss from its Hydra group: ``build_loss(**cfg.loss)``.

    ``loss: {name: hard_ce, gamma: 7, labels: target_argmax}`` maps directly. Unknown names or
    keys raise ``UserError`` listing what is accepted.
    """
    if name not in LOSSES:
        raise UserError(f"loss.name={name!r}: unknown loss; choose one of {sorted(LOSSES)}")
    cls = LOSSES[name]
    allowed = sorted(cls.__dataclass_fields__)
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise UserError(
            f"loss.name={name}: unknown key(s) {unknown} under loss:; accepted keys: {allowed}"
        )
    return cls(**kwargs)
