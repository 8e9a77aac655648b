"""Copy-the-anchor plateau diagnostics, measured at validation per drafter.

An early local optimum of DFlash training: the drafter drafts one token (usually what the
last context state already predicts, the anchor token) in every slot, ignores the anchor
token it is given, and its logits barely differ from slot to slot. Per-slot accuracy is then
flat and real chain acceptance collapses after slot 1. Three numbers show it:

- ``const_block_share``: share of blocks (with >= 2 valid slots) whose drafted tokens are
  all the same token;
- ``anchor_sensitivity``: share of drafted tokens that change when the anchor token (slot 0)
  is replaced by the mask token — a drafter that uses its input changes many;
- ``slot_spread``: mean over blocks of the per-vocab standard deviation of the slots'
  log-probabilities (0 = every slot predicts the same distribution).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

from dflash_lit.train.losses import valid_mask

# A drafter is flagged when most blocks are constant AND the anchor token hardly matters.
CONST_SHARE_FLAG = 0.5
ANCHOR_SENSITIVITY_FLAG = 0.05


class PlateauDiagnostics(Metric):
    """Summable, DDP-synced, persistent sums behind the three plateau numbers."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name, dtype in [("const_blocks", torch.long), ("multi_blocks", torch.long),
                            ("anchor_changed", torch.long), ("anchor_slots", torch.long),
                            ("spread_sum", torch.float64), ("spread_blocks", torch.long)]:
            self.add_state(name, torch.zeros((), dtype=dtype), dist_reduce_fx="sum",
                           persistent=True)

    def update(self, pred: Tensor, pred_masked_anchor: Tensor, labels: Tensor,
               slot_log_probs: Tensor | None = None) -> None:
        """``pred`` / ``pred_masked_anchor`` [B, N, Bs] drafted ids with the real anchor token
        and with the mask token in slot 0; ``labels`` [B, N, Bs]; ``slot_log_probs``
        [M, Bs-1, V] log-softmax of slots 1.. of some valid blocks (for the spread)."""
        valid = valid_mask(labels)
        n_valid = valid.sum(-1)
        multi = n_valid >= 2
        first = torch.where(valid, pred, torch.full_like(pred, -1)).amax(-1, keepdim=True)
        same = (~valid | (pred == first)).all(-1)
        self.const_blocks += (same & multi).sum()
        self.multi_blocks += multi.sum()
        self.anchor_changed += (valid & (pred != pred_masked_anchor)).sum()
        self.anchor_slots += valid.sum()
        if slot_log_probs is not None and slot_log_probs.shape[0]:
            spread = slot_log_probs.float().std(dim=1).mean(-1)  # [M]
            self.spread_sum += spread.double().sum()
            self.spread_blocks += spread.shape[0]

    def compute(self) -> dict[str, Tensor]:
        def div(a: Tensor, b: Tensor) -> Tensor:
            return a.double() / b.double() if int(b) > 0 else torch.tensor(float("nan"))

        return {"const_block_share": div(self.const_blocks, self.multi_blocks),
                "anchor_sensitivity": div(self.anchor_changed, self.anchor_slots),
                "slot_spread": div(self.spread_sum, self.spread_blocks)}


def plateau_message(name: str, const_share: float, anchor_sensitivity: float,
                    slot_spread: float | None = None) -> str | None:
    """A one-line warning when the numbers say copy-the-anchor plateau, else None."""
    if not (const_share >= CONST_SHARE_FLAG and anchor_sensitivity <= ANCHOR_SENSITIVITY_FLAG):
        return None
    spread = f", slot spread {slot_spread:.3f}" if slot_spread is not None else ""
    return (f"drafter {name}: copy-the-anchor plateau ({const_share:.0%} of blocks draft one "
            f"token in every slot, {anchor_sensitivity:.1%} of drafts change without the anchor "
            f"token{spread}). Try: more optimizer steps (smaller data.token_budget), a higher "
            "optim.lr, a mask token whose embedding looks like a trained token's "
            "(target.mask_token_id); see docs/ARCHITECTURE.md")
