"""The DFlash drafter: Qwen3-style layers whose keys/values see the fused target context.

z-lab reference semantics (docs/ARCHITECTURE.md §1). The drafter owns no embedding and no lm_head: block
inputs are embedded with the target's frozen ``embed_tokens`` and its final-normed outputs go
through the target's ``lm_head``. Its state-dict names are exactly the z-lab export names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lit.model.attention import attend
from dflash_lit.model.config import DFlashConfig

# A mask is a dense bool tensor, a flex BlockMask or a masks.BlockwiseMask (see attention.py).
AttnMask = object

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, scale by a learned weight, cast back."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE in the HF ``rotate_half`` convention (the layout Qwen3 weights are trained with)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin of shape [B, P, head_dim] for integer positions [B, P]."""
        freqs = position_ids.float()[..., None] * self.inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, H, P, hd] by cos/sin [B, P, hd]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


@dataclass
class DrafterCache:
    """Per-layer rotated context keys/values of *committed* tokens (inference only).

    Block keys/values are never cached: each draft step recomputes its block, and the cache
    grows only by the context features of tokens the target has accepted.
    """

    keys: list[Tensor | None] = field(default_factory=list)
    values: list[Tensor | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[2]


class DFlashAttention(nn.Module):
    """Block queries attend to [context ; block] keys; the same projections serve both."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.window = cfg.sliding_window
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, p, _ = x.shape
        return x.view(b, p, n, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        ctx: Tensor,
        cos: Tensor,
        sin: Tensor,
        attn_mask: AttnMask | None,
        cache: DrafterCache | None = None,
        layer_idx: int = 0,
    ) -> Tensor:
        b, q_len, _ = x.shape
        c_len = ctx.shape[1]
        q = self.q_norm(self._heads(self.q_proj(x), self.n_heads))
        # k_norm is per-head and position-wise, so norming after the concat equals before it.
        k = self.k_norm(self._heads(self.k_proj(torch.cat([ctx, x], dim=1)), self.n_kv))
        v = self._heads(self.v_proj(torch.cat([ctx, x], dim=1)), self.n_kv)
        # cos/sin cover [new context ; block]; queries use the block's (last q_len) positions.
        q = apply_rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = apply_rope(k, cos, sin)
        if cache is not None:
            while len(cache.keys) <= layer_idx:
                cache.keys.append(None)
                cache.values.append(None)
            k_ctx, v_ctx = k[:, :, :c_len], v[:, :, :c_len]
            if cache.keys[layer_idx] is not None:
                k_ctx = torch.cat([cache.keys[layer_idx], k_ctx], dim=2)
                v_ctx = torch.cat([cache.values[layer_idx], v_ctx], dim=2)
            cache.keys[layer_idx], cache.values[layer_idx] = k_ctx, v_ctx
            k = torch.cat([k_ctx, k[:, :, c_len:]], dim=2)
            v = torch.cat([v_ctx, v[:, :, c_len:]], dim=2)
        if attn_mask is None and self.window is not None:
            # unmasked = one block right after its context (inference, the reference): the
            # window is the last `window` context keys, followed by the block's own keys
            k, v = k[:, :, -(q_len + self.window):], v[:, :, -(q_len + self.window):]
        out = attend(q, k, v, attn_mask)
        out = out.transpose(1, 2).reshape(b, q_len, self.n_heads * self.head_dim)
        return self.o_proj(out)


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer with context-injected attention."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, ctx, cos, sin, attn_mask, cache=None, layer_idx=0) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, attn_mask, cache, layer_idx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """DFlash block-diffusion drafter (z-lab layout).

    Call it like the reference's uncached forward::

        h = drafter(noise_embedding=[B, q, d], target_hidden=[B, c, K*d], position_ids=[B, c+q])

    ``target_hidden`` is the concatenation of the K captured target layers (fc input, where
    training noise is added); ``position_ids`` holds the absolute positions of the c context
    tokens followed by those of the q block tokens. Without ``attention_mask`` every block
    query sees all q block keys and all c context keys (with ``sliding_window`` set, the last
    ``sliding_window`` of them, cached ones included: the block's anchor follows its context).
    For batched training pass a dense boolean mask [B, 1, q, c+q] (True = attend), a flex
    ``BlockMask`` or a ``BlockwiseMask``, built with the window. Returns the final-normed
    hidden states [B, q, d]; apply the target's ``lm_head`` for logits.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        k, d = len(config.target_layer_ids), config.hidden_size
        self.fc = nn.Linear(k * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @torch.no_grad()
    def load_target_layer(self, weights: dict[str, Tensor]) -> list[str]:
        """Initialise every drafter layer from one target decoder layer: ``weights`` maps the
        names under that layer (``self_attn.q_proj.weight``, ``mlp.up_proj.weight``, norms)
        to tensors, plus ``final_norm.weight`` for the drafter's output norm. Entries the
        target lacks (Qwen3's q/k norms for a Llama target) keep their initialisation.
        Returns the names copied; ValueError when a projection is missing or of another
        shape (the drafter must have the target layer's shape: drafter=smollm2 does)."""
        own = self.layers[0].state_dict()
        bad = [f"{k}: drafter {tuple(v.shape)}, target {tuple(weights[k].shape)}"
               for k, v in own.items() if k in weights and weights[k].shape != v.shape]
        needed = [k for k in own if k.endswith("proj.weight") and k not in weights]
        if bad or needed:
            raise ValueError("the target layer does not fit the drafter layer: "
                             + "; ".join(bad + [f"{k}: not in the target layer" for k in needed]))
        copied = [k for k in own if k in weights]
        for layer in self.layers:
            layer.load_state_dict({k: weights[k] for k in copied}, strict=False)
        if "final_norm.weight" in weights:
            self.norm.weight.copy_(weights["final_norm.weight"])
            copied.append("norm.weight")
        return copied

    def project_context(self, target_hidden: Tensor) -> Tensor:
        """Fuse K target layers: ``hidden_norm(fc(concat_K))`` -> [B, c, d]."""
        expected = self.fc.in_features
        if target_hidden.shape[-1] != expected:
            raise ValueError(
                f"target_hidden has last dim {target_hidden.shape[-1]}, drafter expects "
                f"{expected} = {len(self.config.target_layer_ids)} layers x hidden "
                f"{self.config.hidden_size}; check target_layer_ids and the target's hidden size"
            )
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        noise_embedding: Tensor,
        target_hidden: Tensor,
        position_ids: Tensor,
        attention_mask: AttnMask | None = None,
        cache: DrafterCache | None = None,
    ) -> Tensor:
        if noise_embedding.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"noise_embedding hidden size {noise_embedding.shape[-1]} != drafter hidden "
                f"size {self.config.hidden_size}: the drafter must match the target's hidden size"
            )
        ctx = self.project_context(target_hidden)
        c_len, q_len = ctx.shape[1], noise_embedding.shape[1]
        if position_ids.shape[-1] != c_len + q_len:
            raise ValueError(
                f"position_ids has {position_ids.shape[-1]} positions; expected context "
                f"{c_len} + block {q_len} = {c_len + q_len}"
            )
        cos, sin = self.rotary(position_ids, noise_embedding.dtype)
        h = noise_embedding
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, cos, sin, attention_mask, cache, i)
        return self.norm(h)

    # ------------------------------------------------------------------ z-lab IO
    def save_pretrained(self, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in the z-lab layout (docs/ARCHITECTURE.md §3)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_zlab_dict()
        state = {k: v.detach() for k, v in self.state_dict().items()}
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
            cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        else:
            cfg["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        state = {k: v.contiguous().cpu() for k, v in state.items()}
        (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        return out

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> DFlashDrafter:
        """Load a z-lab-layout drafter directory (ours or a published one), strictly."""
        from safetensors.torch import load_file

        p = Path(path)
        if not (p / CONFIG_NAME).is_file():
            raise FileNotFoundError(
                f"{p}: no {CONFIG_NAME}; a drafter directory needs config.json + model.safetensors"
            )
        try:
            raw = json.loads((p / CONFIG_NAME).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p / CONFIG_NAME}:{e.lineno}: invalid JSON ({e.msg})") from None
        try:
            cfg = DFlashConfig.from_zlab_dict(raw)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{p / CONFIG_NAME}: not a DFlash drafter config ({e})") from None
        weights = sorted(p.glob("*.safetensors"))
        if not weights:
            raise FileNotFoundError(f"{p}: no *.safetensors weights next to config.json")
        state: dict[str, Tensor] = {}
        for f in weights:
            state.update(load_file(str(f), device=str(device)))
        model = cls(cfg)
        model.load_exact_state_dict(state, source=str(p))
        model.to(device=device, dtype=dtype or _common_dtype(state))
        return model

    def load_exact_state_dict(self, state: dict[str, Tensor], source: str = "state dict") -> None:
        """Load weights requiring exactly our names and shapes (never a silent partial load)."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"{source}: tensor names do not match the drafter config; "
                f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                f"unexpected {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}"
            )
        for name, t in own.items():
            if tuple(state[name].shape) != tuple(t.shape):
                raise ValueError(
                    f"{source}: tensor {name} has shape {tuple(state[name].shape)}, "
                    f"the config implies {tuple(t.shape)}"
                )
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=True)


def _common_dtype(state: dict[str, Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in state.values()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32

