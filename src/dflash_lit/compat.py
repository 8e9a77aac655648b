"""Can a drafter run on a target? One check for training, evaluation and export."""

from __future__ import annotations

import warnings

from torch import nn

from dflash_lit.errors import UserError
from dflash_lit.hf import text_config
from dflash_lit.model.config import DFlashConfig
from dflash_lit.model.target import FrozenTarget, TargetHeads


def target_dims(target: nn.Module) -> dict[str, int]:
    """hidden_size / num_layers / vocab_size of an HF causal LM (or its wrappers)."""
    if isinstance(target, TargetHeads):
        return {"hidden_size": target.hidden_size, "num_layers": target.num_layers,
                "vocab_size": target.vocab_size}
    model = target.model if isinstance(target, FrozenTarget) else target
    cfg = getattr(model, "config", None)
    text = text_config(cfg)
    hidden = int(model.get_input_embeddings().weight.shape[1])
    head = model.get_output_embeddings()
    vocab = int(head.weight.shape[0]) if head is not None else int(getattr(text, "vocab_size", 0))
    return {"hidden_size": hidden, "num_layers": int(text.num_hidden_layers), "vocab_size": vocab}


def check_compatible(drafter_cfg: DFlashConfig, target: nn.Module | dict[str, int],
                     where: str = "drafter and target") -> dict[str, int]:
    """Raise UserError (naming both values) when the drafter cannot run on ``target``.

    ``target`` is a model or its dims (``hidden_size``, ``num_layers``, ``vocab_size``);
    ``where`` opens the message (e.g. the config key of a drafter). Checks hidden size
    (shared embed / lm_head), that every context layer id exists in the target, vocab size
    (when the drafter records one) and that the mask token is in the target's vocab.
    Returns the target's dims.
    """
    dims = dict(target) if isinstance(target, dict) else target_dims(target)
    c = drafter_cfg
    problems = []
    if c.hidden_size != dims["hidden_size"]:
        problems.append(
            f"hidden size: drafter hidden_size={c.hidden_size} but target hidden size="
            f"{dims['hidden_size']} (the drafter shares the target's embed_tokens / lm_head)"
        )
    bad = [i for i in c.target_layer_ids if not 0 <= i < dims["num_layers"]]
    if bad:
        problems.append(
            f"layer ids: drafter target_layer_ids={c.target_layer_ids} include {bad}, but the "
            f"target has {dims['num_layers']} decoder layers (valid 0..{dims['num_layers'] - 1})"
        )
    if c.vocab_size and c.vocab_size != dims["vocab_size"]:
        problems.append(
            f"vocab: drafter vocab_size={c.vocab_size} but target vocab size={dims['vocab_size']}"
        )
    if not 0 <= c.mask_token_id < dims["vocab_size"]:
        problems.append(
            f"mask token: drafter mask_token_id={c.mask_token_id} is outside the target vocab "
            f"(size {dims['vocab_size']})"
        )
    if not problems and c.num_target_layers != dims["num_layers"]:
        warnings.warn(
            f"drafter num_target_layers={c.num_target_layers} but the target has "
            f"{dims['num_layers']} layers; its ids {c.target_layer_ids} are in range, continuing",
            stacklevel=2,
        )
    if problems:
        raise UserError(
            f"{where} do not match — " + "; ".join(problems)
            + ". Use the drafter with the target it was trained for."
        )
    return dims


def stop_token_ids(config, generation_config=None) -> list[int]:
    """The target's stop ids: ``eos_token_id`` of its config and of its generation config
    (each an int, a list or None)."""
    ids: set[int] = set()
    for c in (config, generation_config):
        eos = getattr(c, "eos_token_id", None) if c is not None else None
        if eos is not None:
            ids.update([int(eos)] if isinstance(eos, int) else (int(e) for e in eos))
    return sorted(ids)


def mask_stop_problem(mask_token_id: int, stop_ids: list[int], where: str) -> str | None:
    """One line when the mask token is one of the target's stop tokens, else None.

    Our evaluator is unaffected, but z-lab's reference decoding loop (the one users try
    first) pre-fills its output buffer with the mask token and ends at the first stop token
    after the prompt: it stops after one block and reports tau 1.0.
    """
    if mask_token_id not in stop_ids:
        return None
    return (f"{where}: mask_token_id={mask_token_id} is a stop token of the target (eos ids "
            f"{stop_ids}): z-lab's reference loop ends after one block with such a drafter; "
            "pick another mask token (target.mask_token_id)")
