"""Acceptance length τ of a DFlash drafter by real greedy speculative decoding.

    python evaluate.py ckpt=outputs/<run>/checkpoints/last.ckpt prompts=humaneval
    python evaluate.py ckpt=drafter_dir/ target=Qwen/Qwen3-8B prompts=jsonl prompts_path=p.jsonl

Config: conf/evaluate.yaml (every key documented). Outputs report.json, summary.md and
acceptance.png in the Hydra run dir; exit status 1 when any method is not lossless.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

import dflash_lit.resolvers  # noqa: F401  (registers ${repo_root:})
from dflash_lit.data.vocab import check_tokenizer_fits
from dflash_lit.eval.loading import check_compatible, load_drafter
from dflash_lit.eval.prompts import load_prompts, render
from dflash_lit.eval.report import (
    EvalSettings,
    LosslessError,
    check_lossless,
    run_evaluation,
    write_outputs,
)
from dflash_lit.export.zlab import DTYPES

log = logging.getLogger("evaluate")


def settings_from_cfg(cfg: DictConfig) -> EvalSettings:
    s = EvalSettings(
        methods=list(cfg.methods),
        budgets=[b for b in cfg.budgets],
        max_new_tokens=cfg.max_new_tokens,
        block_size=cfg.block_size,
        tree_top_k=cfg.tree_top_k,
        ngram_n_max=cfg.ngram.n_max,
        ngram_n_min=cfg.ngram.n_min,
        offline_streak=bool(cfg.offline_streak),
        warmup=bool(cfg.warmup),
    )
    s.validate()
    return s


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose auto or one of {sorted(DTYPES)}")
    return dev, DTYPES[dtype]


def resolve_target_path(cfg: DictConfig, info_target: dict[str, Any]) -> str:
    path = cfg.target or info_target.get("path")
    if not path:
        raise ValueError(
            "no target: the drafter source records none (a z-lab directory); pass target=<HF dir or hub id>"
        )
    p = Path(path)
    looks_local = p.is_absolute() or str(path).startswith(".") or len(p.parts) > 2
    if looks_local and not p.exists():
        where = "target=" if cfg.target else "the checkpoint's dflash.target.path"
        from dflash_lit.targets import build_hint

        raise FileNotFoundError(f"target {path} (from {where}) does not exist; pass "
                                f"target=<path>{build_hint(path)}")
    return str(path)


def eos_ids_for(cfg: DictConfig, tokenizer: Any, model: Any) -> list[int]:
    if cfg.eos_ids is not None:
        return [int(e) for e in cfg.eos_ids]
    ids: set[int] = set()
    for src in (getattr(tokenizer, "eos_token_id", None),
                getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(model.config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(e) for e in src)
    return sorted(ids)


def run(cfg: DictConfig, out_dir: str | Path) -> int:
    """Evaluate per ``cfg``; write outputs to ``out_dir``; return the exit status."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = settings_from_cfg(cfg)  # cheap checks first: bad budgets fail before loading
    prompts = load_prompts(cfg.prompts, cfg.prompts_path, cfg.prompts_field, cfg.limit)
    device, dtype = resolve_device_dtype(str(cfg.device), str(cfg.dtype))
    torch.manual_seed(int(cfg.seed))
    drafter, info = load_drafter(cfg.ckpt, cfg.drafter, dtype=dtype, device=device)
    target_path = resolve_target_path(cfg, info.target)
    log.info("drafter %s (%s), target %s, %d prompts", info.name or info.path, info.source,
             target_path, len(prompts))
    model = AutoModelForCausalLM.from_pretrained(
        target_path, dtype=dtype, attn_implementation=cfg.attn_implementation
    ).to(device).eval()
    dims = check_compatible(drafter.config, model)
    recorded = {k: info.target[k] for k in ("hidden_size", "num_layers", "vocab_size")
                if k in info.target}
    diff = {k: (v, dims[k]) for k, v in recorded.items() if v != dims[k]}
    if diff:
        log.warning("target %s differs from the one recorded at training (recorded, actual): %s",
                    target_path, diff)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or target_path)
    check_tokenizer_fits(tokenizer, dims["vocab_size"], f"tokenizer={cfg.tokenizer or target_path}",
                         "pass tokenizer=<the target's tokenizer dir> (default: the target dir)")
    eos = eos_ids_for(cfg, tokenizer, model)
    encoded = [(p.id, render(p, tokenizer, cfg.chat_template)) for p in prompts]
    report = run_evaluation(model, drafter, encoded, settings, eos, progress=bool(cfg.progress))
    report["drafter"] = info.to_dict()
    report["target"] = {"path": target_path, **dims, "eos_ids": eos,
                        "dtype": str(dtype).removeprefix("torch."), "device": str(device)}
    report["prompts"] = {"set": cfg.prompts, "path": cfg.prompts_path, "limit": cfg.limit}
    report["config"] = OmegaConf.to_container(cfg, resolve=True)
    paths = write_outputs(report, out_dir, plot=bool(cfg.plot))
    print((Path(paths["summary"])).read_text())
    log.info("wrote %s", ", ".join(str(p) for p in paths.values()))
    try:
        check_lossless(report)
    except LosslessError as e:
        log.error("%s", e)
        if dtype != torch.float32:
            log.error("dtype=%s: a near-tie in the target's logits can flip between a batched "
                      "verify pass and one-token decoding; rerun with dtype=float32 to tell "
                      "numerics from a bug", str(dtype).removeprefix("torch."))
        return 1 if cfg.fail_on_mismatch else 0
    return 0


@hydra.main(version_base="1.3", config_path="conf/tools", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    out = cfg.out or HydraConfig.get().runtime.output_dir
    code = run(cfg, out)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
