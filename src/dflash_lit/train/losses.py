"""Drafter losses: one interface (``DrafterLoss``), the configured losses that implement it
(position-weighted hard CE, D-PACE, distillation with any registered divergence, the v3
composite as a preset of it), and their materialised reference functions.

A configured loss says three things, and the training module asks nothing else of it:

- what it needs from the target (``needs_target_logits``: at least the argmax ids;
  ``needs_target_distribution``: the distribution, a cached top-k will do;
  ``full_distribution_reason``: why only the full logits will do);
- each valid slot's loss, CE and divergence from a chunk of logits (``row_loss``), and for
  the fused path its gradient w.r.t. those logits (``row_terms``: by autograd over the chunk
  unless written by hand);
- the slots' weights once every slot's CE is known (``slot_weights``: position decay,
  streak-aware, D-PACE) and the normaliser.

``with_labels`` runs it on materialised logits; ``train/linear_ce.fused_head_loss`` runs the
same terms chunk by chunk with the frozen lm_head and never forms the logits. A new loss is
one ``DrafterLoss`` class registered in ``LOSSES``; a new divergence for ``distill`` is one
class in ``train/divergences.py``.

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

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_lit.config_types import hints_of
from dflash_lit.errors import UserError
from dflash_lit.model.layout import IGNORE
from dflash_lit.train.divergences import get_divergence
from dflash_lit.train.row_terms import (
    HeadChunk,
    RowTerms,
    autograd_terms,
    ce_terms,
    forward_kl_terms,
)

LabelSource = Literal["data", "target_argmax"]
_LABEL_SOURCES: tuple[str, ...] = ("data", "target_argmax")
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


def scatter_slots(values: Tensor, valid: Tensor) -> Tensor:
    """Put per-valid-slot values [M] back into a zero [B, N, Bs] float32 tensor."""
    out = torch.zeros(valid.shape, dtype=torch.float32, device=values.device)
    out[valid] = values.detach().float()
    return out



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



def _check_dpace_args(alpha: float, normalize: str) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise UserError(f"loss.alpha={alpha!r}: the D-PACE confidence smoothing must be in "
                        "[0, 1] (public recipes use 0.5)")
    if normalize not in _NORMALIZE:
        raise UserError(f"loss.normalize={normalize!r}: must be one of {list(_NORMALIZE)} "
                        "('weights': Σ w·CE / Σ w; 'slots': Σ w·CE / valid slots)")



def _check_mix_args(div_weight: float, ce_weight: float, temperature: float,
                    div_key: str, example: str) -> None:
    if not temperature > 0:
        raise UserError(f"loss.temperature={temperature!r}: must be > 0 (v3 uses 2.0)")
    if div_weight < 0 or ce_weight < 0 or (div_weight == 0 and ce_weight == 0):
        raise UserError(
            f"loss.{div_key}={div_weight!r}, loss.ce_weight={ce_weight!r}: both must be >= 0 "
            f"and not both 0 (e.g. {example})"
        )


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


# --------------------------------------------------------------------------- the interface
class DrafterLoss:
    """A configured drafter loss (one subclass per ``loss.name``, a frozen dataclass whose
    fields are the config keys; class settings are set without annotations so that they
    stay out of the fields). Subclasses define ``row_loss`` and ``slot_weights``, may
    write ``row_terms`` by hand, and say what they need from the target.

    The loss of a batch is ``Σ_valid w·ℓ / D`` with ``ℓ`` from ``row_loss`` and
    ``(w, D)`` from ``slot_weights``; ``w`` is detached and depends on the CE only, so the
    fused path can scale each row's gradient once every CE is known.
    """

    labels: LabelSource  # CE labels: data | target_argmax (a field of every subclass)
    where: ClassVar[str] = "loss"  # the name in shape errors
    # Whether the fused path (linear_ce.fused_head_loss) can run it. All built-in losses
    # can; a loss whose terms need more than one row at a time would set False here.
    fused: ClassVar[bool] = True
    # The target's distribution, not only its argmax: full logits online, top-k from a cache.
    needs_target_distribution: ClassVar[bool] = False

    @property
    def label_source(self) -> str:
        return self.labels

    @property
    def needs_target_logits(self) -> bool:
        """Whether the module must compute the target's logits (at least their argmax)."""
        return self.needs_target_distribution or self.labels == "target_argmax"

    @property
    def full_distribution_reason(self) -> str | None:
        """Which setting needs the target's full logits and why (a top-k cache is refused),
        e.g. ``loss.divergence=reverse_kl needs the target's full logits (...)``; else None."""
        return None

    @property
    def needs_full_distribution(self) -> bool:
        return self.full_distribution_reason is not None

    def missing_target(self) -> tuple[str, str, str]:
        """(config value, what to do instead, why) for the error when target logits are
        missing though ``needs_target_distribution``."""
        name = next((k for k, v in LOSSES.items() if v is type(self)), type(self).__name__)
        return (f"loss.name={name}", "use loss.name=hard_ce", "")

    # ---- per slot
    def row_loss(self, z: Tensor, y: Tensor, target: Tensor | None
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(loss [M], CE [M], divergence [M] or None) of float32 logits ``z`` [M, V] with
        labels ``y`` [M] and the target's logits [M, V] (None unless
        ``needs_target_distribution``). Differentiable w.r.t. ``z``."""
        raise NotImplementedError

    def row_terms(self, chunk: HeadChunk) -> RowTerms:
        """``row_loss`` and its gradient w.r.t. the chunk's logits (the fused path)."""
        return autograd_terms(self.row_loss, chunk)

    def slot_weights(self, ce: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """(detached weights [M] of the valid slots, the normaliser D) from their CE [M]
        (in ``valid``'s [B, N, Bs] order)."""
        raise NotImplementedError

    # ---- on materialised logits
    def with_labels(self, logits: Tensor, labels: Tensor,
                    target_logits: Tensor | None = None) -> LossOutput:
        """The loss of ``logits`` [B, N, Bs, V] for labels already resolved from
        ``label_source``."""
        check_block_inputs(logits, labels, target_logits, where=self.where)
        target = None
        if self.needs_target_distribution:
            require_target_logits(target_logits, *self.missing_target())
            target = target_logits
        valid = valid_mask(labels)
        rows, ce, div = self.row_loss(
            logits[valid].float(), labels[valid],
            None if target is None else target[valid].detach().float())
        w, den = self.slot_weights(ce.detach(), valid)
        return LossOutput(
            loss=(w * rows).sum() / den.clamp_min(_TINY),
            per_slot_ce=scatter_slots(ce, valid),
            weight_sum=den.detach(),
            n_valid=valid.sum(),
            per_slot_kl=None if div is None else scatter_slots(div, valid),
        )

    def __call__(self, logits: Tensor, labels: Tensor,
                 target_logits: Tensor | None = None) -> LossOutput:
        """The loss of ``logits`` with labels from ``label_source`` (data / target argmax)."""
        if self.labels == "target_argmax":
            labels = target_argmax_labels(target_logits, labels)
        return self.with_labels(logits, labels, target_logits)


class _CrossEntropyRows(DrafterLoss):
    """Losses whose per-slot term is the CE itself (its gradient written by hand); they
    differ in their slot weights only."""

    def row_loss(self, z, y, target=None):
        ce = F.cross_entropy(z, y, reduction="none")
        return ce, ce, None

    def row_terms(self, chunk: HeadChunk) -> RowTerms:
        return ce_terms(chunk)


# --------------------------------------------------------------------------- configured losses
@dataclass(frozen=True)
class HardCELoss(_CrossEntropyRows):
    """``hard_ce``: CE against ``labels``, slot weights ``exp(-(k-1)/gamma)``, normalised by
    their sum."""

    gamma: float | None = 7.0
    labels: LabelSource = "target_argmax"
    where = "hard_ce_loss"

    def __post_init__(self) -> None:
        _check_label_source(self.labels)
        _check_gamma(self.gamma)

    def slot_weights(self, ce: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        w = position_weights(valid.shape[-1], self.gamma, device=ce.device).expand(valid.shape)
        w = w[valid]
        return w, w.sum()


@dataclass(frozen=True)
class DPaceLoss(_CrossEntropyRows):
    """``dpace``: CE against ``labels`` weighted by D-PACE (``dpace_weights``), times
    ``w_γ(k)`` if ``gamma`` is set."""

    alpha: float = 0.5
    gamma: float | None = None
    normalize: Normalize = "weights"
    labels: LabelSource = "target_argmax"
    where = "dpace_loss"

    def __post_init__(self) -> None:
        _check_label_source(self.labels)
        _check_dpace_args(self.alpha, self.normalize)
        _check_gamma(self.gamma)

    def slot_weights(self, ce: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        w = dpace_slot_weights(ce, valid, self.alpha, self.gamma)
        return w, loss_normaliser(w, self.normalize)


@dataclass(frozen=True)
class DistillLoss(DrafterLoss):
    """``distill``: ``div_weight·T²·D(target, draft at T) + ce_weight·CE`` per slot.

    - ``D`` is the registered divergence ``divergence`` (``train/divergences.py``) between
      ``softmax(target/T)`` and ``softmax(draft/T)``, scaled by ``T²`` (Hinton et al.'s
      convention: the gradient's size then does not shrink with T).
    - CE is plain (T = 1) cross-entropy against ``labels``.
    - Weights ``w_k · s_k``: position decay times, if ``streak_aware``, the detached draft
      probability (T = 1) that slots 1..k-1 were all right (``streak_weights``); normalised
      by their sum.
    """

    divergence: str = "forward_kl"
    gamma: float | None = 7.0
    div_weight: float = 1.0
    ce_weight: float = 0.0
    temperature: float = 1.0
    streak_aware: bool = False
    labels: LabelSource = "target_argmax"  # CE labels (and the training metrics' labels)
    where = "distill_loss"
    needs_target_distribution = True
    div_key = "div_weight"  # the config key of div_weight, for errors

    def __post_init__(self) -> None:
        _check_label_source(self.labels)
        get_divergence(self.divergence)
        _check_mix_args(self.div_weight, self.ce_weight, self.temperature, div_key=self.div_key,
                        example="1.0 / 0.0 for a pure divergence")
        _check_gamma(self.gamma)

    @property
    def full_distribution_reason(self) -> str | None:
        why = get_divergence(self.divergence).needs_full
        return why and f"loss.divergence={self.divergence} needs the target's full logits ({why})"

    def missing_target(self) -> tuple[str, str, str]:
        return (f"loss.divergence={self.divergence}", "use loss.name=hard_ce / dpace", "")

    def row_loss(self, z, y, target):
        t = float(self.temperature)
        ce = F.cross_entropy(z, y, reduction="none")
        div = get_divergence(self.divergence)(
            F.log_softmax(z / t, dim=-1), F.log_softmax(target / t, dim=-1)) * (t * t)
        return self.div_weight * div + self.ce_weight * ce, ce, div

    def row_terms(self, chunk: HeadChunk) -> RowTerms:
        if self.divergence == "forward_kl":  # written by hand: no autograd buffers
            return forward_kl_terms(chunk, self.div_weight, self.ce_weight, self.temperature)
        return super().row_terms(chunk)

    def slot_weights(self, ce: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        w = distill_slot_weights(ce, valid, self.gamma, self.streak_aware)
        return w, w.sum()


@dataclass(frozen=True)
class CompositeLoss(DistillLoss):
    """``composite`` (v3): ``distill`` with forward KL, ``kl_weight`` as its ``div_weight``
    and the v3 defaults (γ = 10, KL 0.7 / CE 0.3 at T = 2, streak-aware, data labels).
    ``conf/loss/composite.yaml`` writes it as a ``distill`` config; the name stays so that
    configs and checkpoints that say ``composite`` keep working."""

    gamma: float | None = 10.0
    kl_weight: float = 0.7
    ce_weight: float = 0.3
    temperature: float = 2.0
    streak_aware: bool = True
    labels: LabelSource = "data"  # CE labels; v3 used the data tokens
    divergence: str = dataclasses.field(default="forward_kl", init=False)
    div_weight: float = dataclasses.field(default=0.7, init=False)
    where = "composite_loss"
    div_key = "kl_weight"

    def __post_init__(self) -> None:
        object.__setattr__(self, "div_weight", self.kl_weight)
        super().__post_init__()

    def missing_target(self) -> tuple[str, str, str]:
        return ("loss.name=composite", "use loss.name=hard_ce", " (its KL term)")


LOSSES: dict[str, type[DrafterLoss]] = {"hard_ce": HardCELoss, "composite": CompositeLoss,
                                        "dpace": DPaceLoss, "distill": DistillLoss}


def build_loss(name: str, **kwargs: Any) -> DrafterLoss:
    """Build a configured loss from its Hydra group: ``build_loss(**cfg.loss)``.

    ``loss: {name: hard_ce, gamma: 7, labels: target_argmax}`` maps directly. Unknown names or
    keys raise ``UserError`` listing what is accepted.
    """
    if name not in LOSSES:
        raise UserError(f"loss.name={name!r}: unknown loss; choose one of {sorted(LOSSES)}")
    cls = LOSSES[name]
    allowed = sorted(hints_of(cls))
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise UserError(
            f"loss.name={name}: unknown key(s) {unknown} under loss:; accepted keys: {allowed}"
        )
    return cls(**kwargs)


# --------------------------------------------------------------------------- functional forms
def hard_ce_loss(logits: Tensor, labels: Tensor, gamma: float | None = 7.0) -> LossOutput:
    """Position-weighted cross-entropy against hard labels:
    ``Σ_valid w_k · CE_k / Σ_valid w_k`` with ``w_k = exp(-(k-1)/gamma)``. With no valid slot
    the loss is an exact 0 that is still attached to the graph. Pass
    ``target_argmax_labels(target_logits, labels)`` as ``labels`` for the target's greedy
    labels."""
    return HardCELoss(gamma, labels="data").with_labels(logits, labels)


def dpace_loss(logits: Tensor, labels: Tensor, alpha: float = 0.5, gamma: float | None = None,
               normalize: Normalize = "weights") -> LossOutput:
    """CE weighted by the detached D-PACE weights (``dpace_weights``), times ``w_γ(k)`` if
    ``gamma`` is set: ``Σ_valid w·CE / D``, ``D = Σ_valid w`` (``weights``) or the number of
    valid slots (``slots``)."""
    return DPaceLoss(alpha, gamma, normalize, labels="data").with_labels(logits, labels)


def distill_loss(logits: Tensor, labels: Tensor, target_logits: Tensor | None,
                 divergence: str = "forward_kl", gamma: float | None = 7.0,
                 div_weight: float = 1.0, ce_weight: float = 0.0, temperature: float = 1.0,
                 streak_aware: bool = False) -> LossOutput:
    """``DistillLoss`` with CE against ``labels`` as given."""
    return DistillLoss(divergence, gamma, div_weight, ce_weight, temperature, streak_aware,
                       labels="data").with_labels(logits, labels, target_logits)


def composite_loss(logits: Tensor, labels: Tensor, target_logits: Tensor | None,
                   gamma: float | None = 10.0, kl_weight: float = 0.7, ce_weight: float = 0.3,
                   temperature: float = 2.0, streak_aware: bool = True) -> LossOutput:
    """The v3 recipe, ``CompositeLoss`` with CE against ``labels`` as given."""
    return CompositeLoss(gamma=gamma, kl_weight=kl_weight, ce_weight=ce_weight,
                         temperature=temperature, streak_aware=streak_aware,
                         labels="data").with_labels(logits, labels, target_logits)
