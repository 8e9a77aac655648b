"""The training layout: N anchor blocks per sequence laid out after the context.

Queries are the Q = N·Bs block tokens; keys are the S context tokens followed by the Q block
tokens (KV = S + Q). One drafter forward computes every block of every sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE = -100


@dataclass
class BlockLayout:
    """Everything the batched training forward needs, derived from (batch, anchors)."""

    anchors: Tensor  # [B, N] anchor positions (0 where invalid)
    valid: Tensor  # [B, N] bool: the block exists
    block_ids: Tensor  # [B, N, Bs] input tokens: [t_a, m, ..., m]
    block_pos: Tensor  # [B, N, Bs] absolute positions a .. a+Bs-1
    labels: Tensor  # [B, N, Bs] token at a+k for k >= 1, IGNORE elsewhere
    context_valid: Tensor  # [B, S] bool: real (non-padding) context tokens
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    @property
    def context_len(self) -> int:
        return self.context_valid.shape[1]

    def position_ids(self) -> Tensor:
        """[B, S + N·Bs]: context positions 0..S-1, then each block's absolute positions."""
        b, s = self.context_valid.shape
        ctx = torch.arange(s, device=self.anchors.device).expand(b, s)
        return torch.cat([ctx, self.block_pos.flatten(1)], dim=1)

    def query_anchor(self) -> Tensor:
        """[B, Q]: anchor of each query's block (0 for invalid blocks, so they see no context)."""
        return self.anchors.repeat_interleave(self.block_size, dim=1)

    def target_positions(self) -> Tensor:
        """[B, N, Bs]: the position whose target logits predict slot k (a + k - 1).

        Clamped into [0, S-1]; the clamped slots (slot 0, past the end) carry IGNORE labels.
        """
        return (self.block_pos - 1).clamp(min=0, max=self.context_len - 1)


def build_layout(
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    valid: Tensor,
    block_size: int,
    mask_token_id: int,
    attention_mask: Tensor | None = None,
) -> BlockLayout:
    """Build block inputs, positions and labels for anchors [B, N] (see ``sample_anchors``).

    Labels are the data tokens at a+k (k >= 1); slots past the sequence end, on prompt tokens
    (``loss_mask == 0``) or in invalid blocks are IGNORE. Label *source* (data vs the
    target's argmax) is the loss's choice, applied later.
    """
    b, s = input_ids.shape
    dev = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    context_valid = attention_mask.bool()
    k = torch.arange(block_size, device=dev)
    pos = anchors[:, :, None] + k  # [B, N, Bs]
    in_range = pos < s
    pos_c = pos.clamp(max=s - 1)
    tok = torch.gather(input_ids, 1, pos_c.flatten(1)).view_as(pos)
    lm = torch.gather(loss_mask.bool() & context_valid, 1, pos_c.flatten(1)).view_as(pos)
    label_ok = in_range & lm & valid[:, :, None] & (k > 0)
    labels = torch.where(label_ok, tok, torch.full_like(tok, IGNORE))
    block_ids = torch.full_like(tok, mask_token_id)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return BlockLayout(
        anchors=anchors,
        valid=valid,
        block_ids=block_ids,
        block_pos=pos,
        labels=labels,
        context_valid=context_valid,
        block_size=block_size,
    )


def gather_target_logits(target_logits: Tensor, layout: BlockLayout) -> Tensor:
    """[B, S, V] target logits -> [B, N, Bs, V]: slot k gets the logits at position a+k-1."""
    b, n, bs = layout.block_pos.shape
    idx = layout.target_positions().flatten(1)  # [B, N*Bs]
    out = torch.gather(target_logits, 1, idx[:, :, None].expand(-1, -1, target_logits.shape[-1]))
    return out.view(b, n, bs, -1)


def gather_target_argmax(argmax: Tensor, layout: BlockLayout) -> Tensor:
    """[B, S] target greedy ids -> [B, N, Bs]: slot k gets the argmax at position a+k-1, the
    token greedy verification accepts at position a+k."""
    idx = layout.target_positions().flatten(1)
    return torch.gather(argmax, 1, idx).view(layout.block_pos.shape)
