"""Decode-time access to an HF causal LM target: KV cache, custom 4D masks, layer capture.

Used by the speculative evaluator. Layer capture reuses ``FrozenTarget``'s forward hooks (z-lab
ids: id i = output of decoder layer i = HF ``hidden_states[i + 1]``), so eval sees exactly the
features training sees. Cache rollback follows transformers 5.x: ``DynamicCache.crop`` takes a
*negative* count (tokens to remove); tree verification keeps the accepted path by compacting
each ``DynamicLayer``'s keys/values in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dflash_lit.model.target import FrozenTarget, cache_kwarg

# Attention implementations that honour an arbitrary 4D additive mask (tree verification).
MASK_CAPABLE_ATTN = ("sdpa", "eager")


@dataclass
class StepOutput:
    """One target forward: next-token logits per input row, captured context features, cache."""

    logits: Tensor  # [q, V] float32
    hidden: Tensor | None  # [1, q, K*d] captured layers, None without capture
    cache: Any


class TargetRunner:
    """Wrap an HF causal LM (or a ``FrozenTarget``) for batch-1 speculative decoding.

    ``layer_ids`` are the drafter's context layers to capture on every forward (None: no
    capture, e.g. for the n-gram baseline or the plain greedy reference).
    """

    def __init__(self, target: nn.Module, layer_ids: list[int] | None = None) -> None:
        model = target.model if isinstance(target, FrozenTarget) else target
        self.model = model.eval()
        self.capture = FrozenTarget(model, list(layer_ids)) if layer_ids else None
        self.cache_kw = cache_kwarg(model)
        emb = model.get_input_embeddings()
        self.embed_tokens = emb
        self.lm_head = model.get_output_embeddings()
        self.device = emb.weight.device
        self.dtype = emb.weight.dtype

    @property
    def attn_implementation(self) -> str:
        cfg = getattr(self.model, "config", None)
        return str(getattr(cfg, "_attn_implementation", None) or "eager")

    @torch.no_grad()
    def forward(
        self,
        input_ids: list[int] | Tensor,
        positions: Tensor,
        cache: Any = None,
        attention_mask: Tensor | None = None,
        use_cache: bool = True,
    ) -> StepOutput:
        """Run ``input_ids`` (one sequence) at ``positions`` [q] on top of ``cache``.

        ``attention_mask``: None for the model's own causal mask (offset by the cache), or a
        4D additive float mask [1, 1, q, cache_len + q] (0 = attend, dtype-min = blocked).
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).view(1, -1)
        pos = positions.to(self.device).view(1, -1)
        kwargs: dict[str, Any] = {"position_ids": pos, "use_cache": use_cache}
        if cache is not None:
            kwargs[self.cache_kw] = cache
        if self.capture is not None:
            out = self.capture(ids, attention_mask=attention_mask, need_logits=True, **kwargs)
            logits, hidden, new_cache = out.logits, out.hidden, out.cache
        else:
            res = self.model(input_ids=ids, attention_mask=attention_mask, **kwargs)
            logits, hidden = res.logits, None
            new_cache = getattr(res, "cache", None)
            if new_cache is None:
                new_cache = getattr(res, "past_key_values", None)
        return StepOutput(logits=logits[0].float(), hidden=hidden, cache=new_cache if use_cache else None)

    def blocked_value(self) -> float:
        return float(torch.finfo(self.dtype).min)

    def additive_mask(self, allowed: Tensor) -> Tensor:
        """bool [q, kv] (True = attend) -> additive [1, 1, q, kv] in the model dtype."""
        m = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        m = m.masked_fill(~allowed.to(self.device), self.blocked_value())
        return m[None, None]


# --------------------------------------------------------------------------- cache surgery
def _dynamic_layer_cls():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def cache_layers(cache: Any) -> list[Any] | None:
    layers = getattr(cache, "layers", None)
    return list(layers) if layers is not None else None


def is_rollbackable(cache: Any) -> bool:
    """True when every cache layer is a plain ``DynamicLayer`` (K/V per position, croppable).

    Recurrent states (Gated DeltaNet ``LinearAttentionLayer``), sliding windows and quantised
    layers cannot drop or re-select arbitrary positions.
    """
    layers = cache_layers(cache)
    dyn = _dynamic_layer_cls()
    return bool(layers) and all(type(layer) is dyn for layer in layers)


def cache_length(cache: Any) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def drop_last(cache: Any, n: int) -> None:
    """Remove the last ``n`` cached positions (transformers 5.x: crop by a negative count)."""
    if n > 0:
        cache.crop(-n)


def keep_tail_rows(cache: Any, past: int, rows: list[int]) -> None:
    """Of the positions after the first ``past``, keep only ``rows`` (relative, ascending).

    The kept rows are copied down in place to ``past .. past+len(rows)-1`` and the rest is
    cropped, so a step costs O(tree size), not a copy of the whole cache.
    """
    total = cache_length(cache)
    idx = torch.tensor(rows, dtype=torch.long) + past
    for layer in cache_layers(cache) or []:
        if getattr(layer, "is_initialized", False) and layer.keys is not None:
            i = idx.to(layer.keys.device)
            # index_select copies first, so the overlapping in-place write is safe.
            layer.keys[..., past:past + len(rows), :] = layer.keys.index_select(-2, i)
            layer.values[..., past:past + len(rows), :] = layer.values.index_select(-2, i)
    drop_last(cache, total - past - len(rows))
