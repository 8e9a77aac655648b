"""Tiny randomly initialised HF targets for tests (deterministic from a seed, CPU-fast).

- ``tiny_qwen3``: ``transformers.Qwen3ForCausalLM`` / ``Qwen3Config`` (dense Qwen3).
- ``tiny_llama``: ``transformers.LlamaForCausalLM`` / ``LlamaConfig`` with tied input/output
  embeddings (the SmolLM2 layout: ``lm_head.weight`` *is* ``embed_tokens.weight``).
- ``tiny_hybrid``: ``transformers.Qwen3_5ForCausalLM`` / ``Qwen3_5TextConfig`` (model_type
  ``qwen3_5_text``), the text-only Qwen3.5 (and Qwen3.6) class: Gated DeltaNet
  ``linear_attention`` layers with a ``full_attention`` layer every ``full_attention_interval``
  layers (config key ``layer_types``, derived from ``full_attention_interval`` when not given).
  On CPU transformers runs the Gated DeltaNet torch fallback (it warns once that fla /
  causal_conv1d are not installed).

Special ids: pad 0, bos 1, eos 2, mask 3 (all < vocab). ``save_tiny`` writes an HF directory
(``config.json`` + ``model.safetensors``) and, by default, a char-level tokenizer using the same
special ids, so ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(dir)`` both work.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

PAD_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>"]


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= MASK_ID:
        raise ValueError(
            f"vocab_size={vocab_size}: the tiny targets reserve ids 0..{MASK_ID} for "
            f"{SPECIAL_TOKENS}; use vocab_size > {MASK_ID}"
        )


def _build(cls: type[PreTrainedModel], config_cls: type, seed: int, vocab_size: int,
           num_layers: int, **fields: Any) -> PreTrainedModel:
    """``cls(config_cls(...))`` with the reserved special ids, weights from ``seed``."""
    _check_vocab(vocab_size)
    config = config_cls(vocab_size=vocab_size, num_hidden_layers=num_layers, pad_token_id=PAD_ID,
                        bos_token_id=BOS_ID, eos_token_id=EOS_ID, **fields)
    # fork_rng: building a tiny target must not shift the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.eval()


def tiny_qwen3(
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 8,
    seed: int = 0,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    **config_overrides: Any,
) -> Qwen3ForCausalLM:
    """A random ``Qwen3ForCausalLM`` (eval mode, float32, untied lm_head), same weights per seed."""
    return _build(
        Qwen3ForCausalLM, Qwen3Config, seed, vocab_size, num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        **config_overrides,
    )


def tiny_llama(
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 8,
    seed: int = 0,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    rope_theta: float = 100_000.0,
    **config_overrides: Any,
) -> LlamaForCausalLM:
    """A random ``LlamaForCausalLM`` (eval mode, float32), same weights per seed.

    Defaults follow SmolLM2's layout: tied embeddings, RoPE base 1e5, no q/k norm, no biases.
    """
    return _build(
        LlamaForCausalLM, LlamaConfig, seed, vocab_size, num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        **config_overrides,
    )


def tiny_hybrid(
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 8,
    seed: int = 0,
    full_attention_interval: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 16,
    linear_value_head_dim: int = 16,
    linear_conv_kernel_dim: int = 4,
    max_position_embeddings: int = 1024,
    **config_overrides: Any,
) -> Qwen3_5ForCausalLM:
    """A random Qwen3.5-style hybrid ``Qwen3_5ForCausalLM`` (Gated DeltaNet + full attention).

    With the defaults, layers 3 and 7 are full attention, the other six Gated DeltaNet. Pass
    ``layer_types=[...]`` in ``config_overrides`` for an explicit pattern.
    """
    if "layer_types" not in config_overrides:
        # Same rule as Qwen3_5TextConfig: every interval-th layer (1-based) is full attention.
        config_overrides["layer_types"] = [
            "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    return _build(
        Qwen3_5ForCausalLM, Qwen3_5TextConfig, seed, vocab_size, num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim,
        linear_conv_kernel_dim=linear_conv_kernel_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        **config_overrides,
    )


def tiny_char_tokenizer(vocab_size: int):
    """A char-level ``PreTrainedTokenizerFast``: the 4 specials, then printable ASCII.

    Characters that do not fit in ``vocab_size`` (or are not printable ASCII) map to pad.
    Decoding concatenates characters, so ``decode(encode(s)) == s`` for printable ASCII.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    _check_vocab(vocab_size)
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars[: vocab_size - len(SPECIAL_TOKENS)]:
        vocab[c] = len(vocab)
    # BPE with no merges and no pre-tokenizer = one token per character.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS[PAD_ID]))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL_TOKENS[PAD_ID],
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        mask_token=SPECIAL_TOKENS[MASK_ID],
        unk_token=SPECIAL_TOKENS[PAD_ID],
    )


def save_tiny(model: PreTrainedModel, out_dir: str | Path, tokenizer: bool = True) -> Path:
    """Write ``model`` as an HF directory (config.json + model.safetensors) [+ char tokenizer]."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer:
        tiny_char_tokenizer(model.config.vocab_size).save_pretrained(out)
    return out
