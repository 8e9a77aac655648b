"""Offline streak: the training metric, measured on the target's own greedy continuations.

Teacher-forced blocks at *every* completion anchor (training's anchor candidates), drafted in
batched forwards with the training layout and dense mask. ``streak`` = leading correct slots
per block; offline τ = mean streak + 1. Real decoding only anchors where the previous step
stopped, so the gap between offline τ and online ``tau_chain`` shows how much the anchors
decoding visits differ from uniform ones (docs/ARCHITECTURE.md §6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_lit.data.anchors import anchor_candidates
from dflash_lit.eval.streak import streak_of
from dflash_lit.eval.target_runner import TargetRunner
from dflash_lit.model.block_forward import draft_hidden
from dflash_lit.model.drafter import DFlashDrafter
from dflash_lit.model.layout import IGNORE, build_layout


@dataclass
class OfflineStreak:
    """Per-block streaks of one sequence and per-slot teacher-forced accuracy counts."""

    anchors: list[int] = field(default_factory=list)  # anchor position of each block
    streaks: list[int] = field(default_factory=list)
    slot_correct: list[int] = field(default_factory=list)
    slot_valid: list[int] = field(default_factory=list)

    @property
    def mean_streak(self) -> float:
        return sum(self.streaks) / len(self.streaks) if self.streaks else float("nan")

    @property
    def tau(self) -> float:
        return self.mean_streak + 1


@torch.no_grad()
def offline_streak(
    target: torch.nn.Module,
    drafter: DFlashDrafter,
    prompt_ids: list[int],
    continuation: list[int],
    block_size: int | None = None,
    chunk: int = 64,
) -> OfflineStreak:
    """Streak of every block anchored in ``prompt + continuation`` whose next token is output.

    ``continuation`` should be the target's greedy output for ``prompt_ids`` (then the data
    labels equal the target's argmax labels). ``chunk`` anchors are drafted per forward.
    """
    bs = int(block_size or drafter.config.block_size)
    runner = TargetRunner(target, list(drafter.config.target_layer_ids))
    seq = list(prompt_ids) + list(continuation)
    s, p = len(seq), len(prompt_ids)
    res = OfflineStreak(slot_correct=[0] * (bs - 1), slot_valid=[0] * (bs - 1))
    if not continuation:
        return res
    out = runner.forward(seq, torch.arange(s), cache=None, use_cache=False)
    dparam = next(drafter.parameters())
    hidden = out.hidden.to(device=dparam.device, dtype=dparam.dtype)
    ids = torch.tensor([seq], device=dparam.device)
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, p:] = 1
    cands = anchor_candidates(loss_mask)[0].nonzero().flatten()
    head = runner.lm_head
    embed = runner.embed_tokens

    def embed_fn(t):
        return embed(t.to(embed.weight.device)).to(dparam.device)

    for start in range(0, cands.numel(), chunk):
        anchors = cands[start:start + chunk][None]
        valid = torch.ones_like(anchors, dtype=torch.bool)
        layout = build_layout(ids, loss_mask, anchors, valid, bs, drafter.config.mask_token_id)
        h = draft_hidden(drafter, embed_fn, hidden, layout, backend="dense")
        pred = head(h.to(device=head.weight.device, dtype=head.weight.dtype)).argmax(-1).cpu()
        labels = layout.labels.cpu()
        ok = (pred == labels)[0, :, 1:]  # [N, Bs-1]
        has = (labels != IGNORE)[0, :, 1:]
        lead = streak_of(ok & has)
        res.anchors.extend(anchors[0].tolist())
        res.streaks.extend(lead.tolist())
        for k in range(bs - 1):
            res.slot_correct[k] += int((ok[:, k] & has[:, k]).sum())
            res.slot_valid[k] += int(has[:, k].sum())
    return res
