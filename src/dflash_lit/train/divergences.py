"""Divergences between the target's distribution ``p`` and the draft's ``q``, per slot.

Each is one class registered under the name ``loss.divergence`` selects; the ``distill``
loss (``train/losses.py``) scales it by ``T²`` and mixes in CE, and both its fused and its
materialised paths use it as it is. A new divergence is one class here (or anywhere that
runs ``register_divergence`` before the loss is built) and one YAML in ``conf/loss/``.

Inputs are float32 log-probabilities [M, V] of the valid slots. The target's ``log_p`` may
be -inf (or, from a top-k cache, a renormalised top k with 0 probability elsewhere);
``0·log 0`` counts as 0.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from dflash_lit.errors import UserError


class Divergence:
    """``D(p, q)`` per row: ``__call__(log_q, log_p) -> [M]``, differentiable w.r.t. ``log_q``.

    ``needs_full``: why a top-k cache cannot serve it (a string), or None when the target's
    top k (p renormalised over it) is enough.
    """

    name: ClassVar[str]
    needs_full: ClassVar[str | None] = None

    def __call__(self, log_q: Tensor, log_p: Tensor) -> Tensor:
        raise NotImplementedError


DIVERGENCE_REGISTRY: dict[str, type[Divergence]] = {}


def register_divergence(cls: type[Divergence]) -> type[Divergence]:
    """Class decorator: make ``cls`` selectable as ``loss.divergence=<cls.name>``."""
    DIVERGENCE_REGISTRY[cls.name] = cls
    return cls


def get_divergence(name: str) -> Divergence:
    """The registered divergence ``name``; ``UserError`` naming ``loss.divergence`` if unknown."""
    if name not in DIVERGENCE_REGISTRY:
        raise UserError(f"loss.divergence={name!r}: must be one of {list(DIVERGENCE_REGISTRY)}")
    return DIVERGENCE_REGISTRY[name]()


def plogp_ratio(log_a: Tensor, log_b: Tensor) -> Tensor:
    """Σ_v a_v·(log a_v − log b_v) per row, with 0·log 0 = 0 (a target logit of -inf)."""
    term = log_a.exp() * (log_a - log_b)
    return torch.where(torch.isneginf(log_a), torch.zeros_like(term), term).sum(-1)


@register_divergence
class ForwardKL(Divergence):
    """KL(p‖q): mass-covering. The fused path has its gradient written by hand
    (``row_terms.forward_kl_terms``)."""

    name = "forward_kl"

    def __call__(self, log_q: Tensor, log_p: Tensor) -> Tensor:
        return plogp_ratio(log_p, log_q)


@register_divergence
class ReverseKL(Divergence):
    """KL(q‖p): mode-seeking; infinite where q has mass that p lacks."""

    name = "reverse_kl"
    needs_full = "KL(q‖p) is unbounded where a top-k cache has p = 0"

    def __call__(self, log_q: Tensor, log_p: Tensor) -> Tensor:
        return plogp_ratio(log_q, log_p)


@register_divergence
class JSD(Divergence):
    """½KL(p‖m) + ½KL(q‖m), m = (p+q)/2: symmetric, bounded by ln 2."""

    name = "jsd"

    def __call__(self, log_q: Tensor, log_p: Tensor) -> Tensor:
        log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
        return 0.5 * (plogp_ratio(log_p, log_m) + plogp_ratio(log_q, log_m))


@register_divergence
class TotalVariation(Divergence):
    """½Σ|p − q| in [0, 1]: 1 − TV is the chance that one token sampled from q is accepted
    by speculative sampling against p."""

    name = "tv"

    def __call__(self, log_q: Tensor, log_p: Tensor) -> Tensor:
        return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
