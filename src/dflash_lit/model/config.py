"""Drafter configuration: a documented dataclass that maps 1:1 onto the z-lab `config.json`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


def default_target_layer_ids(num_target_layers: int, num_context_layers: int) -> list[int]:
    """z-lab default context layers: ``round(1 + j*(L-4)/(K-1))`` for j = 0..K-1.

    Ids mean "output of decoder layer i" (HF ``hidden_states[i + 1]``). For L=64, K=5 this
    gives [1, 16, 31, 46, 61]. Published checkpoints often differ: always store the ids.
    """
    if num_context_layers < 1:
        raise ValueError(f"num_context_layers must be >= 1, got {num_context_layers}")
    if num_context_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    # Python's round() is banker's rounding; the formula means round-half-up.
    ids = [int(1 + j * span / (num_context_layers - 1) + 0.5) for j in range(num_context_layers)]
    return ids


@dataclass
class DFlashConfig:
    """Shape and semantics of a DFlash drafter (Qwen3-style layers, z-lab conventions)."""

    hidden_size: int = 256  # d: must equal the target's hidden size (shared embed / lm_head)
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # GQA key/value heads; divides num_attention_heads
    head_dim: int = 64  # per-head width (Qwen3 decouples it from hidden_size / heads)
    intermediate_size: int = 768  # SwiGLU MLP width
    num_hidden_layers: int = 1  # N_d drafter layers (1-5 in published drafters)
    block_size: int = 16  # Bs: tokens drafted per block, slot 0 is the given anchor token
    mask_token_id: int = 0  # id of the mask token filling slots 1..Bs-1
    num_target_layers: int = 8  # L: decoder layers of the target (for the default ids)
    target_layer_ids: list[int] = field(default_factory=list)  # K context layers; [] -> formula
    num_context_layers: int = 5  # K used only when target_layer_ids is empty
    vocab_size: int = 0  # target vocab (bounds mask_token_id; 0 = unchecked)
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 1_000_000.0  # RoPE base
    max_position_embeddings: int = 32768  # recorded for serving engines
    attention_bias: bool = False  # bias on q/k/v/o projections (Qwen3: False)
    sliding_window: int | None = None  # a block anchored at a sees context [a - w, a); None = all

    def __post_init__(self) -> None:
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(
                self.num_target_layers, self.num_context_layers
            )
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.num_context_layers = len(self.target_layer_ids)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming the offending field and what to do about it."""
        if self.block_size < 2:
            raise ValueError(
                f"block_size={self.block_size}: a block needs the anchor plus at least one "
                "drafted slot; use block_size >= 2 (16 in published drafters)"
            )
        ids = self.target_layer_ids
        if len(set(ids)) != len(ids):
            raise ValueError(f"target_layer_ids={ids} contains duplicates; list each layer once")
        bad = [i for i in ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids={ids}: {bad} out of range for a target with "
                f"{self.num_target_layers} decoder layers (valid: 0..{self.num_target_layers - 1}, "
                "id i = output of decoder layer i)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.vocab_size and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the target vocab "
                f"(size {self.vocab_size}); add a mask token to the tokenizer or pick an id < vocab"
            )
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers={self.num_hidden_layers}: need at least 1 layer")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < self.block_size):
            # serving engines window each query, bidirectionally: a window narrower than the
            # block would hide block keys there that training lets every slot see
            raise ValueError(
                f"sliding_window={w!r}: must be an integer >= block_size={self.block_size} "
                "(context keys a block sees before its anchor), or null for the whole context"
            )

    # ------------------------------------------------------------------ z-lab config.json
    def to_zlab_dict(self) -> dict[str, Any]:
        """The z-lab / vLLM / SGLang `config.json` content (docs/ARCHITECTURE.md §3)."""
        d = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }
        if self.sliding_window is not None:
            # How vLLM, SGLang and z-lab's loader read a window: HF Qwen3's sliding_window +
            # use_sliding_window (without it HF drops the window) and layer_types. They make
            # a sliding layer causal within the block unless told otherwise; ours is
            # bidirectional: is_causal (z-lab, vLLM) and dflash_config.causal (vLLM) say so
            # (SGLang has no such switch: its sliding layers stay causal).
            d.update(use_sliding_window=True, sliding_window=self.sliding_window,
                     layer_types=["sliding_attention"] * self.num_hidden_layers, is_causal=False)
            d["dflash_config"]["causal"] = False
        return d

    @classmethod
    def from_zlab_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        """Read a z-lab `config.json` dict (published drafters or our own export)."""
        dc = d.get("dflash_config", {})
        rope_theta = d.get("rope_theta")
        if rope_theta is None:  # transformers 5 writes rope parameters in a sub-dict
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        heads = d["num_attention_heads"]
        try:
            return cls(
                hidden_size=d["hidden_size"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads", heads),
                head_dim=d.get("head_dim", d["hidden_size"] // heads),
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                block_size=d.get("block_size", 16),
                mask_token_id=dc.get("mask_token_id", d.get("mask_token_id", 0)),
                num_target_layers=d["num_target_layers"],
                target_layer_ids=list(dc.get("target_layer_ids", [])),
                vocab_size=d.get("vocab_size", 0) or 0,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                max_position_embeddings=d.get("max_position_embeddings", 32768),
                attention_bias=d.get("attention_bias", False),
                sliding_window=read_sliding_window(d),
            )
        except KeyError as e:
            raise ValueError(f"drafter config.json is missing required field {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_sliding_window(d: dict[str, Any]) -> int | None:
    """The context window of a z-lab-style ``config.json`` (None: full attention).

    Accepted: every layer sliding (``layer_types``, or vLLM's ``dflash_config.use_swa``) and
    bidirectional within the block (``is_causal`` / ``dflash_config.causal`` false; vLLM and
    z-lab default a ``layer_types`` sliding layer to causal). Anything else this drafter cannot
    run the way the checkpoint was trained: a ValueError says which.
    """
    dc = d.get("dflash_config") or {}
    types = d.get("layer_types")
    kinds = set(types or [])
    if len(kinds) > 1 or not kinds <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer_types={types}: mixed or unknown layer types; this drafter "
                         "supports all full_attention or all sliding_attention layers")
    if kinds != {"sliding_attention"} and not (types is None and dc.get("use_swa")):
        return None
    causal = d.get("is_causal", dc.get("causal", types is not None))
    if causal:
        raise ValueError("sliding-window layers causal within the block (is_causal / "
                         "dflash_config.causal not false) are not supported: this drafter "
                         "attends bidirectionally within a block")
    window = dc.get("swa_window_size", d.get("sliding_window"))
    if window is None:
        raise ValueError("sliding-window layers without a size: set sliding_window")
    return int(window)
