"""``evaluate.py``: acceptance length τ of a drafter by real greedy speculative decoding.

Config: ``conf/tools/evaluate.yaml``. Writes report.json, summary.md and acceptance.png; the
exit status is 1 when a method is not lossless (and ``fail_on_mismatch``), 2 on a user error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dflash_lit.compat import check_compatible
from dflash_lit.data.render import PromptRenderer, resolve_chat
from dflash_lit.data.vocab import check_tokenizer_fits, tokenizer_fingerprint
from dflash_lit.dtypes import parse_dtype
from dflash_lit.errors import UserError, input_checks
from dflash_lit.eval.loading import DrafterInfo, load_drafter
from dflash_lit.eval.prompts import load_prompts
from dflash_lit.eval.report import (
    EvalSettings,
    LosslessError,
    check_lossless,
    run_evaluation,
    write_outputs,
)
from dflash_lit.eval.suffix_engine import SuffixSettings

log = logging.getLogger("evaluate")


def settings_from_cfg(cfg: DictConfig) -> EvalSettings:
    """Validated decoding settings (cheap: before anything loads)."""
    s = EvalSettings(
        methods=list(cfg.methods),
        budgets=[b for b in cfg.budgets],
        max_new_tokens=cfg.max_new_tokens,
        block_size=cfg.block_size,
        tree_top_k=cfg.tree_top_k,
        ngram_n_max=cfg.ngram.n_max,
        ngram_n_min=cfg.ngram.n_min,
        ngram_rule=str(cfg.ngram.rule),
        ngram_tokens=cfg.ngram.num_speculative_tokens,
        suffix=suffix_settings(cfg.suffix),
        suffix_budget=int(cfg.suffix_tree.budget),
        suffix_tree_depth=cfg.suffix_tree.max_tree_depth,
        suffix_depth=int(cfg.suffix_tree.depth),
        suffix_min_prob=float(cfg.suffix_tree.min_prob),
        offline_streak=bool(cfg.offline_streak),
        warmup=bool(cfg.warmup),
        trim_drafts=bool(cfg.trim_drafts),
    )
    s.validate()
    return s


def suffix_settings(node: DictConfig) -> SuffixSettings:
    """vLLM's suffix decoding settings from the ``suffix`` config group."""
    n = node.num_speculative_tokens
    return SuffixSettings(max_tree_depth=int(node.max_tree_depth),
                          num_speculative_tokens=None if n is None else int(n),
                          max_spec_factor=float(node.max_spec_factor),
                          min_token_prob=float(node.min_token_prob),
                          max_cached_requests=int(node.max_cached_requests))


def resolve_device(device: str) -> torch.device:
    """``auto`` → cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise UserError(f"device={device!r}: {e}; use auto, cpu, cuda or cuda:N") from None


def resolve_target_path(cfg: DictConfig, info_target: dict[str, Any]) -> str:
    """``target=`` (a directory, hub id or a ``conf/target`` name such as ``smollm2``) or the
    path the checkpoint recorded; a local path must exist."""
    from dflash_lit.targets import named_target_path

    path = cfg.target or info_target.get("path")
    path = named_target_path(str(path)) or path
    if not path:
        raise UserError(
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
    """``eos_ids`` or every eos id the tokenizer, generation config and model config name."""
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


def make_renderer(cfg: DictConfig, tokenizer: Any, where: str) -> PromptRenderer:
    """The prompt renderer regeneration would build from the same keys."""
    kwargs = OmegaConf.to_container(cfg.chat_template_kwargs, resolve=True) or {}
    if not isinstance(kwargs, dict):
        raise UserError(f"chat_template_kwargs={kwargs!r}: must be a mapping, e.g. "
                        "{enable_thinking: false}")
    return PromptRenderer(tokenizer, resolve_chat(cfg.chat, tokenizer, where), cfg.system_prompt,
                          kwargs)


def draft_vocab_for(cfg: DictConfig, info: DrafterInfo) -> torch.Tensor | None:
    """The ids the drafter drafts over: its checkpoint's training vocab with ``draft_vocab=true``."""
    if not cfg.get("draft_vocab"):
        return None
    if not info.train_vocab:
        raise UserError(
            f"draft_vocab=true: {info.path} records no training vocabulary (it was trained with "
            "train_vocab=null, before checkpoints recorded it, or it is a z-lab directory); "
            "set draft_vocab=false"
        )
    return torch.tensor(info.train_vocab, dtype=torch.long)


def evaluate(cfg: DictConfig, out_dir: str | Path) -> int:
    """Evaluate per ``cfg``; write outputs to ``out_dir``; return the exit status."""
    from transformers import AutoModelForCausalLM

    settings = settings_from_cfg(cfg)  # cheap checks first: bad budgets fail before loading
    prompts = load_prompts(cfg.prompts, cfg.prompts_path, cfg.prompts_field, cfg.limit)
    device = resolve_device(str(cfg.device))
    dtype = parse_dtype(str(cfg.dtype), "dtype", device=device)
    torch.manual_seed(int(cfg.seed))
    with input_checks():  # the files the user named: drafter, target, tokenizer
        drafter, info = load_drafter(cfg.ckpt, cfg.drafter, dtype=dtype, device=device,
                                     trust=cfg.trust_checkpoint)
        vocab = draft_vocab_for(cfg, info)
        target_path = resolve_target_path(cfg, info.target)
        log.info("drafter %s (%s), target %s, %d prompts", info.name or info.path, info.source,
                 target_path, len(prompts))
        model = AutoModelForCausalLM.from_pretrained(
            target_path, dtype=dtype, attn_implementation=cfg.attn_implementation
        ).to(device).eval()
        dims = check_compatible(drafter.config, model)
        tokenizer, renderer, encoded = encode_prompts(cfg, prompts, target_path, dims["vocab_size"])
    recorded = {k: info.target[k] for k in ("hidden_size", "num_layers", "vocab_size")
                if k in info.target}
    diff = {k: (v, dims[k]) for k, v in recorded.items() if v != dims[k]}
    if diff:
        log.warning("target %s differs from the one recorded at training (recorded, actual): %s",
                    target_path, diff)
    eos = eos_ids_for(cfg, tokenizer, model)
    report = run_evaluation(model, drafter, encoded, settings, eos, progress=bool(cfg.progress),
                            draft_vocab=vocab)
    report["drafter"] = info.to_dict()
    report["target"] = {"path": target_path, **dims, "eos_ids": eos,
                        "dtype": str(dtype).removeprefix("torch."), "device": str(device)}
    report["prompts"] = {"set": cfg.prompts, "path": cfg.prompts_path, "limit": cfg.limit}
    report["rendering"] = {**renderer.settings(), "tokenizer": cfg.tokenizer or target_path,
                           "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)}
    report["config"] = OmegaConf.to_container(cfg, resolve=True)
    return _write_and_check(cfg, report, out_dir, dtype == torch.float32)


def configs_without_weights(path: str) -> SimpleNamespace:
    """The target's config and generation config (None if it has none), standing in for the
    model where only they are read (``eos_ids_for``, ``config_dims``)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(path)
    except OSError:
        gen = None
    return SimpleNamespace(config=AutoConfig.from_pretrained(path), generation_config=gen)


def config_dims(config: Any) -> dict[str, int]:
    """hidden_size / num_layers / vocab_size from a target's config (no weights loaded)."""
    from dflash_lit.hf import text_config

    text = text_config(config)
    return {"hidden_size": int(text.hidden_size), "num_layers": int(text.num_hidden_layers),
            "vocab_size": int(text.vocab_size)}


def encode_prompts(cfg: DictConfig, prompts: list[Any], target_path: str,
                   vocab_size: int) -> tuple[Any, PromptRenderer, list[tuple[str, list[int]]]]:
    """The tokenizer (checked against the target's vocab), its renderer and the prompts' ids."""
    from transformers import AutoTokenizer

    tok_where = f"tokenizer={cfg.tokenizer or target_path}"
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or target_path)
    check_tokenizer_fits(tokenizer, vocab_size, tok_where,
                         "pass tokenizer=<the target's tokenizer dir> (default: the target dir)")
    renderer = make_renderer(cfg, tokenizer, tok_where)
    return tokenizer, renderer, [(p.id, renderer.ids(p)) for p in prompts]


def evaluate_in_engine(cfg: DictConfig, out_dir: str | Path) -> int:
    """``engine=vllm``: the same prompts, rendering and outputs, served by vLLM."""
    from dflash_lit.eval.vllm_engine import (
        EngineError,
        EngineSettings,
        check_installed,
        run_engine_evaluation,
    )
    from dflash_lit.export.zlab import export_zlab

    check_installed()
    settings = settings_from_cfg(cfg)
    engine = EngineSettings(concurrency=[int(c) for c in cfg.vllm.concurrency],
                            max_model_len=int(cfg.vllm.max_model_len),
                            memory_fraction=float(cfg.vllm.memory_fraction),
                            timeout_s=float(cfg.vllm.timeout_s),
                            repeats=cfg.vllm.repeats,
                            extra_args=OmegaConf.to_container(cfg.vllm.extra_args, resolve=True) or {})
    engine.validate()
    if cfg.draft_vocab or cfg.trim_drafts:
        raise UserError("draft_vocab / trim_drafts: vLLM serves neither; use engine=inprocess")
    prompts = load_prompts(cfg.prompts, cfg.prompts_path, cfg.prompts_field, cfg.limit)
    dtype = "float32" if str(cfg.dtype) == "auto" else str(cfg.dtype)
    parse_dtype(dtype, "dtype")
    out = Path(out_dir)
    # the model-free methods need no drafter: ckpt may stay unset without chain
    with_drafter = "chain" in settings.methods or not OmegaConf.is_missing(cfg, "ckpt")
    with input_checks():
        drafter, info = (load_drafter(cfg.ckpt, cfg.drafter, trust=cfg.trust_checkpoint)
                         if with_drafter else (None, None))
        target_path = resolve_target_path(cfg, info.target if info else {})
        stand_in = configs_without_weights(target_path)
        dims = config_dims(stand_in.config)
        if drafter is not None:
            check_compatible(drafter.config, dims,
                             f"drafter {cfg.ckpt} and the served target {target_path}")
        tokenizer, renderer, encoded = encode_prompts(cfg, prompts, target_path, dims["vocab_size"])
        if info is None:
            drafter_dir = None
        elif info.source == "zlab":
            drafter_dir = str(Path(cfg.ckpt).resolve())
        else:  # a training checkpoint: exported next to the report, as vLLM reads it
            drafter_dir = str((out / "drafter").resolve())
            export_zlab(cfg.ckpt, drafter_dir, name=cfg.drafter, trust=cfg.trust_checkpoint)
    eos = eos_ids_for(cfg, tokenizer, stand_in)
    bs = int(settings.block_size or (drafter.config.block_size if drafter is not None else 16))
    log.info("vLLM: target %s, drafter %s, %d prompts, concurrency %s", target_path, drafter_dir,
             len(encoded), engine.concurrency)
    try:
        report = run_engine_evaluation(target_path, cfg.tokenizer or target_path, drafter_dir,
                                       encoded, settings, engine, eos, dtype, bs,
                                       out / "engine_runs", progress=bool(cfg.progress))
    except EngineError as e:
        log.error("%s", e)
        return 3
    report["drafter"] = None if info is None else {**info.to_dict(), "served_from": drafter_dir}
    report["target"] = {"path": target_path, **dims, "eos_ids": eos, "dtype": dtype,
                        "device": "vllm"}
    report["prompts"] = {"set": cfg.prompts, "path": cfg.prompts_path, "limit": cfg.limit}
    report["rendering"] = {**renderer.settings(), "tokenizer": cfg.tokenizer or target_path,
                           "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)}
    report["config"] = OmegaConf.to_container(cfg, resolve=True)
    return _write_and_check(cfg, report, out, dtype == "float32")


def _write_and_check(cfg: DictConfig, report: dict[str, Any], out_dir: str | Path,
                     float32: bool) -> int:
    """Write the outputs, print the summary; 1 when a method is not lossless."""
    paths = write_outputs(report, out_dir, plot=bool(cfg.plot))
    print(Path(paths["summary"]).read_text())
    log.info("wrote %s", ", ".join(str(p) for p in paths.values()))
    try:
        check_lossless(report)
    except LosslessError as e:
        log.error("%s", e)
        if not float32:
            log.error("dtype=%s: a near-tie in the target's logits can flip between a batched "
                      "verify pass and one-token decoding; rerun with dtype=float32 to tell "
                      "numerics from a bug", cfg.dtype)
        return 1 if cfg.fail_on_mismatch else 0
    return 0


def main(cfg: DictConfig) -> int:
    """The body of ``evaluate.py``: outputs go to ``out`` or the Hydra run directory."""
    from hydra.core.hydra_config import HydraConfig

    out = cfg.out or HydraConfig.get().runtime.output_dir
    if cfg.engine == "vllm":
        return evaluate_in_engine(cfg, out)
    if cfg.engine != "inprocess":
        raise UserError(f"engine={cfg.engine!r}: choose inprocess or vllm")
    return evaluate(cfg, out)
