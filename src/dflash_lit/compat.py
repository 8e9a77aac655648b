"""Can a drafter run on a target? One check for training, evaluation and export."""

from __future__ import annotations

import warnings

from torch import nn

from dflash_lit.errors import UserError
from dflash_lit.model.config import DFlashConfig
from dflash_lit.model.target import FrozenTarget, TargetHeads


def target_dims(target: nn.Module) -> dict[str, int]:
    """hidden_size / num_layers / vocab_size of an HF causal LM (or its wrappers)."""
    if isinstance(target, TargetHeads):
        return {"hidden_size": target.hidden_size, "num_layers": target.num_layers,
                "vocab_size": target.vocab_size}
    model = target.model if isinstance(target, FrozenTarget) else target
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
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
