"""Build a training run from a composed Hydra config: target, drafter specs, data, trainer."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dflash_lit.compat import mask_stop_problem, stop_token_ids
from dflash_lit.config_types import check_values
from dflash_lit.dtypes import parse_dtype
from dflash_lit.errors import UserError
from dflash_lit.hf import text_config
from dflash_lit.model.config import DFlashConfig, default_target_layer_ids
from dflash_lit.train.losses import build_loss
from dflash_lit.train.overrides import DRAFTER_KEYS, check_loss, check_overrides, check_schedule
from dflash_lit.train.spec import AnchorSpec, DrafterSpec, NoiseSpec

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- target
def target_hf_config(tcfg: DictConfig):
    """The target's HF config without loading weights (for layer counts, sizes)."""
    if tcfg.get("path"):
        from transformers import AutoConfig

        from dflash_lit.targets import missing_target_message

        p = Path(str(tcfg.path)).expanduser()
        msg = missing_target_message(p)
        if msg:
            raise FileNotFoundError(msg)
        return AutoConfig.from_pretrained(str(p))
    if tcfg.get("build"):
        return _build_random(tcfg.build).config
    raise UserError("target: set target.path (an HF model dir) or target.build (random tiny)")


def _build_random(build: DictConfig):
    from dflash_lit.tiny import random_targets

    kw = OmegaConf.to_container(build, resolve=True)
    kind = kw.pop("kind")
    fn = {"tiny_qwen3": random_targets.tiny_qwen3, "tiny_hybrid": random_targets.tiny_hybrid,
          "tiny_llama": random_targets.tiny_llama}
    if kind not in fn:
        raise UserError(f"target.build.kind={kind!r}: use one of {sorted(fn)}")
    return fn[kind](**kw)


def build_target(tcfg: DictConfig, layer_ids: list[int]):
    """FrozenTarget capturing ``layer_ids`` (the union over drafters)."""
    from dflash_lit.model.target import FrozenTarget

    dtype = parse_dtype(tcfg.get("dtype", "float32"), "target.dtype")
    if tcfg.get("path"):
        return FrozenTarget.from_pretrained(
            tcfg.path, layer_ids, dtype=dtype,
            attn_implementation=tcfg.get("attn_implementation", "sdpa"),
        )
    model = _build_random(tcfg.build).to(dtype)
    return FrozenTarget(model, layer_ids)


def build_target_heads(tcfg: DictConfig, layer_ids: list[int]):
    """The target's embed_tokens + lm_head only (training from cached features)."""
    from dflash_lit.model.target import TargetHeads

    dtype = parse_dtype(tcfg.get("dtype", "float32"), "target.dtype")
    if tcfg.get("path"):
        return TargetHeads.from_pretrained(tcfg.path, layer_ids, dtype=dtype)
    return TargetHeads.from_model(_build_random(tcfg.build).to(dtype), layer_ids)


def resolve_mask_token_id(tcfg: DictConfig, vocab_size: int) -> int:
    """Mask id from ``target.mask_token_id`` or the tokenizer's ``target.mask_token``."""
    if tcfg.get("mask_token_id") is not None:
        mid = int(tcfg.mask_token_id)
    elif tcfg.get("mask_token") and tcfg.get("path"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tcfg.path))
        mid = tok.convert_tokens_to_ids(tcfg.mask_token)
        if mid is None or mid == tok.unk_token_id:
            raise UserError(
                f"target.mask_token={tcfg.mask_token!r} is not in the tokenizer at {tcfg.path}; "
                "add it as a special token or set target.mask_token_id"
            )
    else:
        raise UserError("target: no mask token; set target.mask_token_id or target.mask_token")
    if not 0 <= mid < vocab_size:
        raise UserError(f"target.mask_token_id={mid} is outside the vocab (size {vocab_size})")
    return mid


def _architectures(hf) -> list[str]:
    """The config's ``architectures``, or the causal-LM class of its model_type (configs built
    in memory have none)."""
    if getattr(hf, "architectures", None):
        return list(hf.architectures)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf, "model_type", None) or "")
    return [name] if isinstance(name, str) else []


def target_info(tcfg: DictConfig) -> dict[str, Any]:
    hf = text_config(target_hf_config(tcfg))
    return {
        "path": str(tcfg.path) if tcfg.get("path") else None,
        "build": OmegaConf.to_container(tcfg.build, resolve=True) if tcfg.get("build") else None,
        "hidden_size": int(hf.hidden_size),
        "num_layers": int(hf.num_hidden_layers),
        "vocab_size": int(hf.vocab_size),
        "model_type": getattr(hf, "model_type", None),
        # what a serving engine pairing the exported drafter with this target needs to know
        "architectures": _architectures(hf),
        "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
        "eos_token_ids": stop_token_ids(hf, _generation_config(tcfg)),
    }


def _generation_config(tcfg: DictConfig):
    """The target directory's generation config (its stop tokens), None without one."""
    if not tcfg.get("path"):
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(tcfg.path))
    except OSError:  # no generation_config.json
        return None


# ---------------------------------------------------------------------- drafters
def _merge_section(cfg: DictConfig, over: DictConfig, key: str) -> dict[str, Any]:
    base = OmegaConf.to_container(cfg[key], resolve=True) if key in cfg else {}
    extra = OmegaConf.to_container(over[key], resolve=True) if over and key in over else {}
    merged = OmegaConf.merge(base, extra)
    return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]


def build_specs(cfg: DictConfig, info: dict[str, Any]) -> list[DrafterSpec]:
    """One DrafterSpec per entry of ``drafters:``, defaults from the drafter/loss/schedule/optim groups."""
    if not cfg.get("drafters"):
        raise UserError("drafters: empty; give at least one drafter (conf/drafters/single.yaml)")
    mask_id = resolve_mask_token_id(cfg.target, info["vocab_size"])
    problem = mask_stop_problem(mask_id, info.get("eos_token_ids", []), "target")
    if problem:
        log.warning(problem)
    specs = []
    for name, over in cfg.drafters.items():
        over = over or OmegaConf.create({})
        raw = OmegaConf.to_container(over, resolve=True) if OmegaConf.is_config(over) else over
        check_overrides(str(name), raw)  # before merging: a bad override names its own path
        loss = _merge_section(cfg, over, "loss")
        if raw.get("loss"):
            check_loss(f"drafters.{name}.loss", raw["loss"], loss.get("name"))
        d = _merge_section(cfg, over, "drafter")
        sched = _merge_section(cfg, over, "schedule")
        opt = _merge_section(cfg, over, "optim")
        check_values(d, DRAFTER_KEYS, "drafter")
        check_schedule("schedule", sched)
        check_loss("loss", loss, loss.get("name"))
        build_loss(**loss)  # range checks of loss.* (γ > 0, ...) before any weights load
        L = info["num_layers"]
        ids = d.pop("target_layer_ids", None)
        k = int(d.pop("num_context_layers", 5))
        drop = int(d.pop("drop_last_context_layers", 0))
        if not ids:
            ids = context_layer_ids(cfg.target, L, k)
            ids = ids[: len(ids) - drop] if drop else ids
        hidden = d.pop("hidden_size", None) or info["hidden_size"]
        init_layer = d.pop("init_from_target_layer", None)
        if init_layer is not None and not 0 <= int(init_layer) < L:
            raise UserError(f"drafters.{name}: drafter.init_from_target_layer={init_layer} is "
                            f"not a layer of the target (0..{L - 1})")
        try:
            model = DFlashConfig(
                hidden_size=int(hidden), num_target_layers=L, target_layer_ids=list(ids),
                vocab_size=info["vocab_size"], mask_token_id=mask_id, **d,
            )
        except (TypeError, ValueError) as e:  # name the drafter (config keys: drafter.*)
            raise UserError(f"drafters.{name}: {e}") from None
        specs.append(
            DrafterSpec(
                name=str(name), model=model, loss=loss,
                noise=NoiseSpec(**sched.get("noise", {})),
                anchors=_scaled_anchors(sched.get("anchors", {}), float(cfg.get("anchor_scale", 1.0))),
                lr=float(opt["lr"]), weight_decay=float(opt.get("weight_decay", 0.0)),
                grad_clip=float(opt.get("grad_clip", 1.0)), init_from_target_layer=init_layer,
            )
        )
    return specs


def context_layer_ids(tcfg: DictConfig, num_layers: int, k: int) -> list[int]:
    """The K context layers when the drafter lists none: the target config's explicit
    ``context_layer_ids`` when it has K entries, else the z-lab formula for ``num_layers``."""
    stated = tcfg.get("context_layer_ids")
    if stated and len(stated) == k:
        return [int(i) for i in stated]
    return default_target_layer_ids(num_layers, k)


def _scaled_anchors(anchors: dict[str, Any], scale: float) -> AnchorSpec:
    """Anchors per sequence times ``anchor_scale`` (conf/budget/): recipes count anchors for
    ~3k-token sequences; shorter data keeps the same anchor density with fewer."""
    if not 0 < scale <= 1:
        raise UserError(f"anchor_scale={scale}: must be in (0, 1] (conf/budget/)")
    spec = AnchorSpec(**anchors)
    if scale == 1.0:
        return spec
    spec.max = max(1, round(spec.max * scale))
    if spec.start is not None:
        spec.start = max(1, round(spec.start * scale))
    return spec


# ---------------------------------------------------------------------- loggers
def wandb_offline(setting: Any) -> bool:
    """``auto``: offline unless an API key is configured (env or ~/.netrc)."""
    if setting in (True, False):
        return bool(setting)
    if os.environ.get("WANDB_API_KEY"):
        return False
    netrc = Path.home() / ".netrc"
    return not (netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"))


def build_loggers(lcfg: DictConfig | None, run_dir: Path, resume_dir: Path | None) -> list:
    import hydra

    loggers = []
    for conf in (lcfg or {}).values():
        if conf is None:
            continue
        conf = OmegaConf.to_container(conf, resolve=True)
        if "WandbLogger" in conf.get("_target_", ""):
            if os.environ.get("WANDB_MODE") == "disabled":
                continue  # tests / explicit opt-out: no W&B object at all
            conf["offline"] = wandb_offline(conf.get("offline", "auto"))
            for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
                os.environ.setdefault(var, str(run_dir / "wandb" / ".cache"))
            prev = resume_dir / "wandb_id.txt" if resume_dir else None
            if prev is not None and prev.is_file():
                conf["id"] = prev.read_text().strip()  # continue the same W&B run
                conf["resume"] = "allow"
        loggers.append(hydra.utils.instantiate(conf))
    return loggers


def build_callbacks(ccfg: DictConfig | None) -> list:
    import hydra

    return [hydra.utils.instantiate(c) for c in (ccfg or {}).values() if c is not None]


def target_layer_state(tcfg: DictConfig, layer: int) -> dict[str, Any]:
    """One decoder layer of the target (names under the layer) and its final norm
    (``final_norm.weight``), read without loading the rest of a pretrained target."""
    if tcfg.get("path"):
        from dflash_lit.model.target import target_layer_weights

        return target_layer_weights(str(tcfg.path), layer)
    model = _build_random(tcfg.build)
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return {**inner.layers[layer].state_dict(), "final_norm.weight": inner.norm.weight.detach()}
