"""Analytic FLOP counts of one training step (a multiply-add = 2 FLOPs).

Drafter forward, per batch (T block tokens, C padded context tokens, K context layers,
width d, H/Hkv heads of size hd, SwiGLU width I, N_d layers, vocab V):

    fc       2·C·K·d·d
    per layer  2·T·d·H·hd (q) + 2·(T+C)·d·2·Hkv·hd (k, v of block + context)
             + 2·T·H·hd·d (o) + 2·T·3·d·I (MLP) + 4·H·hd·P (QKᵀ and PV over P visible pairs)
    lm_head  2·T·d·V

P = Σ over block queries of the keys they see (context before the anchor + Bs of their own
block): the block-sparse work, whatever kernel computes it. Training = forward + backward
≈ 3× forward, except the frozen lm_head whose weight gradient is never formed (2×).
Target forward over R real tokens: 2·R·(decoder weights) + causal attention
4·Σ_layers H·hd·Σ_seq S(S+1)/2 + the lm_head 2·R·d·V when its logits are needed.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_lit.model.config import DFlashConfig
from dflash_lit.model.layout import BlockLayout


def visible_pairs(layout: BlockLayout) -> int:
    """P: Σ over valid block queries of their visible keys (context < anchor + own block)."""
    v = layout.valid
    # context keys before the anchor that are real tokens
    cum = layout.context_valid.long().cumsum(1)
    a = layout.anchors.clamp(min=1)
    ctx = torch.gather(cum, 1, a - 1) * (layout.anchors > 0)
    return int(((ctx + layout.block_size) * layout.block_size * v).sum())


def drafter_forward_flops(cfg: DFlashConfig, layout: BlockLayout) -> dict[str, float]:
    """Forward FLOPs of one drafter on ``layout`` split into body (trainable) and lm_head."""
    d, hd, h, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    k = len(cfg.target_layer_ids)
    t = int(layout.valid.sum()) * layout.block_size
    c = layout.context_valid.numel()
    p = visible_pairs(layout)
    layer = (2 * t * d * h * hd + 2 * (t + c) * d * 2 * hkv * hd + 2 * t * h * hd * d
             + 2 * t * 3 * d * cfg.intermediate_size + 4 * h * hd * p)
    body = 2 * c * k * d * d + cfg.num_hidden_layers * layer
    return {"body": float(body), "lm_head": float(2 * t * d * cfg.vocab_size),
            "block_tokens": float(t), "visible_pairs": float(p)}


def drafter_train_flops(cfg: DFlashConfig, layout: BlockLayout) -> float:
    f = drafter_forward_flops(cfg, layout)
    return 3 * f["body"] + 2 * f["lm_head"]


def target_forward_flops(model: nn.Module, attention_mask: torch.Tensor, need_logits: bool) -> float:
    """Forward FLOPs of the HF target over the real tokens of a batch."""
    cfg = model.config
    layers = model.model.layers
    dec = sum(m.weight.numel() for m in layers.modules() if isinstance(m, nn.Linear))
    real = attention_mask.sum(1).double()
    r = float(real.sum())
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 4 * len(layers) * cfg.num_attention_heads * hd * float((real * (real + 1) / 2).sum())
    head = 2 * r * cfg.hidden_size * cfg.vocab_size if need_logits else 0.0
    return 2 * r * dec + attn + head
