"""Size presets of the tiny Qwen3 target and its pretraining run, and the config builder.

``default`` is what ships in ``artifacts/tiny/target``; ``toy`` builds in seconds for tests.
``max_steps`` is fixed per preset (measured once on a shared 2-core CPU), so the shipped
model does not depend on machine speed; ``--max-minutes`` is only a safety cap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


@dataclass(frozen=True)
class TinyPreset:
    """Everything that determines the tiny build besides the seed."""

    name: str
    # corpus / tokenizer
    include_tests: bool = False
    max_files: int | None = None  # cap on corpus files (toy), None = all
    heldout_frac: float = 0.02
    vocab_size: int = 4096
    # model (Qwen3)
    num_hidden_layers: int = 8
    hidden_size: int = 256
    intermediate_size: int = 768
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    # pretraining
    seq_len: int = 512
    batch_size: int = 8
    max_steps: int = 600  # 2.46M tokens: ~45-70 min at 600-900 tok/s, 1 thread, shared 2-core CPU
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    val_every: int = 200
    val_chunks: int = 48
    ckpt_every: int = 50
    # prompts
    max_train_prompts: int = 4000
    max_eval_prompts: int = 200
    save_dtype: str = "bfloat16"

    def to_dict(self) -> dict:
        """Plain dict (for build_info.json)."""
        return asdict(self)


PRESETS: dict[str, TinyPreset] = {
    "default": TinyPreset(name="default"),
    "toy": TinyPreset(
        name="toy", max_files=24, heldout_frac=0.1, vocab_size=512, num_hidden_layers=2,
        hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=256, seq_len=64, batch_size=4, max_steps=6,
        lr=3e-3, warmup_steps=2, val_every=3, val_chunks=4, ckpt_every=3,
        max_train_prompts=40, max_eval_prompts=8,
    ),
}


def get_preset(name: str, **overrides) -> TinyPreset:
    """A preset by name, with dataclass-field overrides (``None`` values are ignored)."""
    if name not in PRESETS:
        raise KeyError(f"unknown tiny preset {name!r}; choose one of {sorted(PRESETS)}.")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


def make_config(p: TinyPreset, eos_id: int = 0) -> Qwen3Config:
    """Qwen3 config for a preset; pad/bos/eos are the tokenizer's ``<|endoftext|>`` id."""
    if p.num_attention_heads % p.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads.")
    if eos_id >= p.vocab_size:
        raise ValueError(f"eos id {eos_id} must be < vocab_size {p.vocab_size}.")
    return Qwen3Config(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        head_dim=p.head_dim,
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=p.tie_word_embeddings,
        rope_theta=p.rope_theta,
        pad_token_id=eos_id,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        attention_dropout=0.0,
        use_cache=True,
    )


def make_model(p: TinyPreset, seed: int, eos_id: int = 0) -> Qwen3ForCausalLM:
    """Freshly initialised fp32 model; the init depends only on ``seed``."""
    torch.manual_seed(seed)
    cfg = make_config(p, eos_id)
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg)
