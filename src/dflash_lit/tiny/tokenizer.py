"""Byte-level BPE tokenizer for the tiny target, trained with ``tokenizers``.

Special tokens (ids fixed by their order): ``<|endoftext|>`` = 0 (eos/pad/bos),
``<|mask|>`` = 1 (the DFlash mask token), ``<|im_start|>`` = 2, ``<|im_end|>`` = 3.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
MASK = "<|mask|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, MASK, IM_START, IM_END]


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenisation, no added prefix space).

    Deterministic for a fixed ordered input: the BPE trainer breaks count ties by pair.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size={vocab_size} must exceed the 256 byte symbols + specials.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def wrap_hf(tok: Tokenizer, model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Wrap as a HF fast tokenizer with eos/pad/bos/mask set (no BOS is prepended)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        bos_token=EOS,
        mask_token=MASK,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path | None = None
                    ) -> PreTrainedTokenizerFast:
    """Train, wrap and optionally save (tokenizer.json + tokenizer_config.json) to ``out_dir``."""
    hf = wrap_hf(train_bpe(texts, vocab_size))
    if out_dir is not None:
        save_tokenizer(hf, out_dir)
    return hf


def save_tokenizer(tok: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """``save_pretrained`` + name the class ``PreTrainedTokenizerFast`` in tokenizer_config.json.

    transformers 5 writes ``TokenizersBackend``, which 4.x loaders (e.g. in serving engines)
    do not know; ``PreTrainedTokenizerFast`` loads in both.
    """
    tok.save_pretrained(str(out_dir))
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
