"""``export.py``: a trained drafter in the z-lab layout (vLLM ``dflash`` / SGLang ``DFLASH``).

Config: ``conf/tools/export.yaml``. Writes config.json, model.safetensors and a README.md
with serve commands, then reloads the export and compares it with the source; the exit
status is 1 when that check fails, 2 on a user error.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from dflash_lit.compat import check_compatible, stop_token_ids
from dflash_lit.dtypes import parse_dtype
from dflash_lit.errors import input_checks
from dflash_lit.eval.loading import load_drafter
from dflash_lit.export.card import load_report
from dflash_lit.export.zlab import export_zlab

log = logging.getLogger("export")


def export(cfg: DictConfig) -> int:
    """Export per ``cfg``; return the exit status (1 when the reload check fails)."""
    dtype = parse_dtype(cfg.dtype, "dtype", keep=True)
    lm_head, stops = None, None  # without a target: the stop ids the training run recorded
    with input_checks():  # the checkpoint and target the user named
        if cfg.target:
            from transformers import AutoModelForCausalLM

            from dflash_lit.targets import named_target_path

            target = named_target_path(str(cfg.target)) or cfg.target  # e.g. target=smollm2
            model = AutoModelForCausalLM.from_pretrained(target).eval()
            drafter, _ = load_drafter(cfg.ckpt, cfg.drafter, trust=cfg.trust_checkpoint)
            check_compatible(drafter.config, model)
            lm_head = model.get_output_embeddings()
            stops = stop_token_ids(model.config, getattr(model, "generation_config", None))
        report = load_report(cfg.card_report)
        res = export_zlab(cfg.ckpt, cfg.out, name=cfg.drafter, dtype=dtype, lm_head=lm_head,
                          trust=cfg.trust_checkpoint, stop_ids=stops, card_report=report)
    limit = cfg.max_abs_diff if cfg.max_abs_diff is not None else (0.0 if dtype is None else None)
    print(f"exported {res.name or cfg.ckpt} -> {res.out_dir} ({res.dtype})")
    print(f"reload check: weights equal={res.weights_equal}, max abs diff outputs="
          f"{res.max_abs_diff:.3g}, logits={res.logits_max_abs_diff:.3g}"
          + ("" if cfg.target else " (random lm_head: the target's is not in the checkpoint)"))
    if not res.weights_equal or (limit is not None and res.max_abs_diff > limit):
        log.error("reloaded export does not match the source (limit %s)", limit)
        return 1
    return 0

