"""Offline drafter metrics: accuracy, per-position accuracy, streak, DDTree acceptance.

Pure functions on ``(logits [B, N, Bs, V], labels [B, N, Bs])`` (conventions of
``dflash_lit.train.losses``: -100 = invalid, slot 0 never counts), and ``DrafterMetrics``, a
torchmetrics ``Metric`` with summable, persistent, DDP-synced states.

Definitions:
- ``acc``: top-1 accuracy over valid slots.
- ``streak``: per block, the number of leading correct slots from slot 1, stopping at the
  first wrong *or invalid* slot; mean over valid blocks (blocks with >= 1 valid slot). This is
  the offline chain acceptance τ−1.
- ``ddtree_b{b}``: per block, the depth accepted along the labels by the budget-b DDTree
  built from the per-slot top-k log-probs of slots 1..Bs-1 (``dflash_lit.eval.ddtree``);
  mean over valid blocks. Offline τ−1 of tree verification.

How tree acceptance relates to the streak (tested in tests/test_metrics.py):
- topk = 1: the tree is the greedy chain cut at b nodes, so ``tree == min(streak, b)``.
- Always ``tree >= min(streak, c_b)`` where ``c_b`` is the depth the all-rank-0 chain reaches
  inside the budget-b tree (>= 1 for b >= 1), and tree acceptance never decreases with b.
- With b >= Σ_{d=1}^{Bs-1} k^d (whole tree) it is the top-k streak (leading labels inside
  their slot's top-k) >= streak.
- It is NOT true that ``tree >= streak`` whenever b >= Bs-1: best-first spends budget on
  high-scoring siblings and may not hold the whole greedy chain (example in the tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

from dflash_lit.eval.ddtree import batched_label_acceptance, build_ddtree_batched
from dflash_lit.eval.streak import streak_of
from dflash_lit.model.layout import IGNORE
from dflash_lit.train.losses import LossOutput, check_block_inputs, valid_mask

__all__ = [
    "DrafterMetrics",
    "accuracy",
    "accuracy_per_position",
    "block_correct",
    "offline_tree_acceptance",
    "streak",
    "streak_lengths",
    "topk_log_probs",
    "tree_acceptance_lengths",
    "valid_blocks",
]


def _nan_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den in float64, NaN where den == 0 (no data is not 0 % accuracy)."""
    num, den = num.double(), den.double()
    return torch.where(den > 0, num / den.clamp(min=1), torch.full_like(num, float("nan")))


# --------------------------------------------------------------------------- pure functions
def predictions(logits: Tensor, labels: Tensor, where: str) -> Tensor:
    """Top-1 ids [B, N, Bs] from logits [B, N, Bs, V], or ``logits`` itself when it already
    holds predictions [B, N, Bs] (the fused loss returns ids, never logits)."""
    if logits.dim() == 3 and not logits.is_floating_point():
        if logits.shape != labels.shape:
            raise ValueError(f"{where}: predictions {tuple(logits.shape)} must have the labels' "
                             f"shape {tuple(labels.shape)}")
        return logits
    check_block_inputs(logits, labels, where=where)
    return logits.detach().argmax(-1)


def block_correct(logits: Tensor, labels: Tensor) -> Tensor:
    """[B, N, Bs] bool: valid slot whose top-1 prediction equals its label (``logits`` may
    be predicted ids [B, N, Bs])."""
    return valid_mask(labels) & (predictions(logits, labels, "block_correct") == labels)


def valid_blocks(labels: Tensor) -> Tensor:
    """[B, N] bool: blocks with at least one valid slot (not padding)."""
    return valid_mask(labels).any(-1)


def accuracy(logits: Tensor, labels: Tensor) -> Tensor:
    """Top-1 accuracy over valid slots (float64 scalar; NaN with no valid slot)."""
    return _nan_div(block_correct(logits, labels).sum(), valid_mask(labels).sum())


def accuracy_per_position(logits: Tensor, labels: Tensor) -> Tensor:
    """[Bs] float64 top-1 accuracy per slot over valid slots (NaN at slot 0 / empty slots)."""
    correct = block_correct(logits, labels).flatten(0, 1).sum(0)
    return _nan_div(correct, valid_mask(labels).flatten(0, 1).sum(0))


def streak_lengths(logits: Tensor, labels: Tensor) -> Tensor:
    """[B, N] int64: leading correct slots from slot 1, stopping at the first wrong/invalid."""
    return streak_of(block_correct(logits, labels)[..., 1:])


def streak(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean streak over valid blocks (offline chain τ−1); float64, NaN with no valid block."""
    vb = valid_blocks(labels)
    return _nan_div(streak_lengths(logits, labels)[vb].sum(), vb.sum())


def topk_log_probs(logits: Tensor, k: int, chunk_rows: int = 4096) -> tuple[Tensor, Tensor]:
    """Top-k log-softmax values (float32, sorted desc) and ids of ``logits`` [..., V].

    ``topk`` runs on the raw logits (same order as on log-probs) and only the row's
    logsumexp is taken in float32, chunk by chunk, so no full float32 copy of a
    150k-vocab tensor is ever alive.
    """
    v = logits.shape[-1]
    if not 1 <= k <= v:
        raise ValueError(f"topk={k}: must be between 1 and the vocab size {v}")
    flat = logits.detach().reshape(-1, v)
    vals, ids = [], []
    for start in range(0, flat.shape[0], chunk_rows):
        chunk = flat[start : start + chunk_rows]
        top = chunk.topk(k, dim=-1, sorted=True)
        lse = torch.logsumexp(chunk.float(), dim=-1, keepdim=True)
        vals.append(top.values.float() - lse)
        ids.append(top.indices)
    shape = (*logits.shape[:-1], k)
    if not vals:
        empty = torch.empty(shape, dtype=torch.float32, device=logits.device)
        return empty, torch.empty(shape, dtype=torch.long, device=logits.device)
    return torch.cat(vals).reshape(shape), torch.cat(ids).reshape(shape)


def _resolve_topk(topk: int | None, budget: int, vocab: int) -> int:
    # k >= budget is already exact: a rank-r node needs r earlier siblings inside the budget.
    return min(budget if topk is None else topk, budget, vocab)


def tree_acceptance_lengths(
    logits: Tensor, labels: Tensor, budget: int, topk: int | None = None
) -> Tensor:
    """[B, N] int64: accepted depth along the labels of each block's budget-b DDTree.

    The tree is built from slots 1..Bs-1's top-k log-probs (depth d = slot d); 0 for
    invalid blocks. ``topk=None`` means k = budget, which is exact (the same tree as k = V).
    """
    check_block_inputs(logits, labels, where="tree_acceptance_lengths")
    b, n, bs, v = logits.shape
    k = _resolve_topk(topk, budget, v)
    out = torch.zeros((b, n), dtype=torch.long, device=logits.device)
    vb = valid_blocks(labels)
    if not bool(vb.any()):
        return out
    lp, ids = topk_log_probs(logits[vb], k)  # [M, Bs, k]
    tree = build_ddtree_batched(lp[:, 1:], ids[:, 1:], budget)
    lab = torch.where(valid_mask(labels), labels, torch.full_like(labels, IGNORE))[vb]
    out[vb] = batched_label_acceptance(tree, lab)
    return out


def offline_tree_acceptance(
    logits: Tensor, labels: Tensor, budget: int, topk: int | None = None
) -> Tensor:
    """Mean over valid blocks of ``tree_acceptance_lengths`` (float64; NaN with no block)."""
    vb = valid_blocks(labels)
    return _nan_div(tree_acceptance_lengths(logits, labels, budget, topk)[vb].sum(), vb.sum())


# --------------------------------------------------------------------------- torchmetrics
class DrafterMetrics(Metric):
    """Accumulates loss, acc, acc_pos/k, streak and optional ddtree_b{b} over updates.

    All states are sums (``dist_reduce_fx="sum"``, ``persistent=True``), so they sync
    exactly under DDP and survive a checkpoint (``state_dict``/``load_state_dict``).

    ``update(logits, labels, loss)``: ``loss`` is a ``LossOutput`` (weighted by its
    ``weight_sum``, so the accumulated loss equals the one-shot loss over all batches), a
    scalar tensor (each update weighs 1), or None. Do not mix the two kinds in one epoch.
    ``compute()`` returns a dict; log it with ``self.log_dict(m.compute())`` then ``m.reset()``.
    ``tree_budgets`` (e.g. ``(16, 32)``) adds ``ddtree_b{b}``: a few vectorised steps per
    budget node, cheap on GPU, noticeable on CPU, so off by default.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(
        self,
        block_size: int,
        tree_budgets: Sequence[int] = (),
        tree_topk: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"DrafterMetrics: block_size={block_size!r} must be an int >= 2")
        budgets = [int(b) for b in tree_budgets]
        if any(b < 1 for b in budgets) or len(set(budgets)) != len(budgets):
            raise ValueError(
                f"DrafterMetrics: tree_budgets={list(tree_budgets)} must be distinct ints >= 1"
            )
        if tree_topk is not None and tree_topk < 1:
            raise ValueError(f"DrafterMetrics: tree_topk={tree_topk} must be >= 1 or None")
        self.block_size = block_size
        self.tree_budgets = budgets
        self.tree_topk = tree_topk

        def add(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
            self.add_state(
                name, torch.zeros(shape, dtype=dtype), dist_reduce_fx="sum", persistent=True
            )

        add("loss_sum", (), torch.float64)
        add("loss_weight", (), torch.float64)
        add("n_valid", (), torch.long)
        add("n_correct", (), torch.long)
        add("pos_correct", (block_size,), torch.long)
        add("pos_valid", (block_size,), torch.long)
        add("n_blocks", (), torch.long)
        add("streak_sum", (), torch.long)
        add("tree_sum", (len(budgets),), torch.long)

    def update(
        self, logits: Tensor, labels: Tensor, loss: LossOutput | Tensor | None = None
    ) -> None:
        """Add one batch (``logits`` [B, N, Bs, V] or predicted ids [B, N, Bs]; ``labels``
        [B, N, Bs]). Tree budgets need the logits."""
        pred = predictions(logits, labels, "DrafterMetrics.update")
        if self.tree_budgets and logits.dim() == 3:
            raise ValueError("DrafterMetrics.update: ddtree budgets need the logits, got ids")
        if labels.shape[2] != self.block_size:
            raise ValueError(
                f"DrafterMetrics.update: blocks have size {labels.shape[2]}, the metric "
                f"was built for block_size={self.block_size}"
            )
        logits = logits.detach()
        valid = valid_mask(labels)
        correct = valid & (pred == labels)
        vb = valid.any(-1)
        self.n_valid += valid.sum()
        self.n_correct += correct.sum()
        self.pos_valid += valid.flatten(0, 1).sum(0)
        self.pos_correct += correct.flatten(0, 1).sum(0)
        self.n_blocks += vb.sum()
        self.streak_sum += streak_of(correct[..., 1:])[vb].sum()
        for i, budget in enumerate(self.tree_budgets):
            self.tree_sum[i] += tree_acceptance_lengths(
                logits, labels, budget, self.tree_topk
            ).sum()
        if isinstance(loss, LossOutput):
            w = loss.weight_sum.detach().double()
            self.loss_sum += loss.loss.detach().double() * w
            self.loss_weight += w
        elif loss is not None:
            self.loss_sum += loss.detach().double().sum()
            self.loss_weight += 1.0

    def compute(self) -> dict[str, Tensor]:
        """``{loss, acc, streak, acc_pos/1..Bs-1, ddtree_b{b}}`` (NaN where nothing counted)."""
        out = {
            "loss": _nan_div(self.loss_sum, self.loss_weight),
            "acc": _nan_div(self.n_correct, self.n_valid),
            "streak": _nan_div(self.streak_sum, self.n_blocks),
        }
        acc_pos = _nan_div(self.pos_correct, self.pos_valid)
        for k in range(1, self.block_size):
            out[f"acc_pos/{k}"] = acc_pos[k]
        for i, budget in enumerate(self.tree_budgets):
            out[f"ddtree_b{budget}"] = _nan_div(self.tree_sum[i], self.n_blocks)
        return out
