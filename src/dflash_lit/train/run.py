"""``train(cfg)``: the body of train.py — compose, validate, build, fit, return the monitor."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dflash_lit.atomic import remove_stale_temporaries
from dflash_lit.checkpoint import check_matches, loader_world_size
from dflash_lit.data.frequent_tokens import frequent_tokens
from dflash_lit.data.vocab import check_data_tokenizer
from dflash_lit.errors import UserError, input_checks
from dflash_lit.precision import head_dtype
from dflash_lit.train.build import (
    build_callbacks,
    build_loggers,
    build_specs,
    build_target,
    build_target_heads,
    target_info,
    target_layer_state,
)
from dflash_lit.train.checkpointing import AtomicCheckpointIO
from dflash_lit.train.feature_cache import (
    CACHED,
    attach_feature_caches,
    build_target_config,
    cache_needs_distribution,
    check_features_config,
    resolve_topk,
)
from dflash_lit.train.losses import build_loss
from dflash_lit.train.module import DFlashModule, ModuleSettings
from dflash_lit.train.resume import resolve_ckpt_path
from dflash_lit.train.spec import capture_layer_ids, muon_settings
from dflash_lit.train.validate import check_config


def _auto(value, on_cuda, off_cuda):
    return (on_cuda if torch.cuda.is_available() else off_cuda) if value == "auto" else value


def _world_size(tcfg: DictConfig) -> int:
    devices = tcfg.get("devices", 1)
    nodes = int(tcfg.get("num_nodes", 1) or 1)
    if isinstance(devices, int) and devices > 0:
        return devices * nodes
    if isinstance(devices, list | tuple):
        return len(devices) * nodes
    n = torch.cuda.device_count() if tcfg.get("accelerator") in ("gpu", "cuda", "auto") else 1
    return max(n, 1) * nodes


def total_training_steps(cfg: DictConfig, dm) -> int:
    """Optimizer steps of the whole run, from config + data (never estimated_stepping_batches,
    which drops the saved dataloader state on resume: Lightning #20550)."""
    max_steps = int(cfg.trainer.get("max_steps", -1) or -1)
    if max_steps > 0:
        return max_steps
    epochs = int(cfg.trainer.get("max_epochs", 1) or 1)
    world = _world_size(cfg.trainer)
    if hasattr(dm, "train_batches_per_epoch"):
        per_epoch = dm.train_batches_per_epoch(world)
    else:  # every rank gets the same count: the global batches split evenly
        per_epoch = math.ceil(len(dm.train_sampler) / world)
    accum = int(cfg.trainer.get("accumulate_grad_batches", 1) or 1)
    return max(1, epochs * math.ceil(per_epoch / accum))


def build_run(cfg: DictConfig) -> tuple[DFlashModule, L.LightningDataModule, int]:
    """Validated data + models of a run: (module, datamodule set up for fit, total steps).

    Cheap checks come first (target config without weights, drafter specs, data) so bad input
    fails before any weights load. Shared by ``train`` and the bench/ scripts.
    """
    check_config(cfg)
    mode = check_features_config(cfg.features, cfg.target)  # before the data is read
    info = target_info(cfg.target)
    specs = build_specs(cfg, info)
    max_bs = max(s.model.block_size for s in specs)
    dm = hydra.utils.instantiate(
        cfg.data, vocab_size=info["vocab_size"], block_size=max_bs, seed=int(cfg.seed)
    )
    dm.setup("fit")
    check_data_tokenizer({"data.path": cfg.data.get("path"), "data.val_path": cfg.data.get("val_path")},
                         cfg.target.get("path"))
    total = total_training_steps(cfg, dm)
    train_vocab = None  # counted before features attach: the rows' tokens only
    if cfg.get("train_vocab") is not None:
        train_vocab = frequent_tokens(dm.train_dataset, int(cfg.train_vocab), info["vocab_size"])
    capture = capture_layer_ids(specs)
    if mode in CACHED:
        need_dist = cache_needs_distribution({s.name: build_loss(**s.loss) for s in specs})
        attach_feature_caches(cfg, dm, capture, need_dist,
                              lambda: build_target(build_target_config(cfg), capture),
                              (info["num_layers"], info["hidden_size"]))
        target = build_target_heads(cfg.target, capture)  # decoder layers never loaded
    elif mode == "vllm_server":
        from dflash_lit.train.feature_servers import attach_feature_servers

        need_dist = cache_needs_distribution({s.name: build_loss(**s.loss) for s in specs})
        dm.feature_gate = attach_feature_servers(
            cfg, dm, capture, resolve_topk(cfg.features, need_dist), info["hidden_size"])
        target = build_target_heads(cfg.target, capture)
    else:
        target = build_target(cfg.target, capture)
    module = DFlashModule(target, specs, module_settings(cfg, total), target_info=info,
                          train_vocab=train_vocab)
    for s in specs:  # a checkpoint being resumed overwrites these weights, as any init
        if s.init_from_target_layer is not None:
            try:
                copied = module.drafters[s.name].load_target_layer(
                    target_layer_state(cfg.target, s.init_from_target_layer))
            except ValueError as e:
                raise UserError(f"drafters.{s.name}: drafter.init_from_target_layer="
                                f"{s.init_from_target_layer}: {e}") from None
            print(f"drafter {s.name}: {len(copied)} tensors initialised from target layer "
                  f"{s.init_from_target_layer}")
    return module, dm, total


def module_settings(cfg: DictConfig, total_steps: int) -> ModuleSettings:
    """The module's run-wide settings from a composed train.py config."""
    return ModuleSettings(
        total_steps=total_steps,
        warmup_frac=float(cfg.optim.warmup_frac),
        min_lr_ratio=float(cfg.optim.min_lr_ratio),
        betas=tuple(cfg.optim.betas),
        eps=float(cfg.optim.eps),
        muon=muon_settings(OmegaConf.to_container(cfg.optim, resolve=True)),  # None: adamw
        attention=str(cfg.attention),  # auto: chosen per batch shape by the module
        compile_mask=bool(_auto(cfg.compile_mask, True, False)),
        seed=int(cfg.seed),
        val_max_anchors=int(cfg.val_max_anchors),
        log_tree_budgets=tuple(cfg.log_tree_budgets or ()),
        max_nonfinite_in_row=int(cfg.max_nonfinite_in_row),
        head_dtype=head_dtype(str(cfg.trainer.get("precision", "32-true"))),
        loss_chunk_rows=int(cfg.loss_chunk_rows),
    )


def compose_train(overrides: Sequence[str], run_dir: str | Path) -> DictConfig:
    """``conf/train.yaml`` composed as ``python train.py <overrides>`` composes it, with the
    run directory ``run_dir`` (for notebooks, bench scripts and tests: no Hydra app)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    import dflash_lit.resolvers  # noqa: F401  (registers ${repo_root:}, ${cpu_precision:}, ...)
    from dflash_lit.paths import repo_root

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(repo_root()) / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    return cfg


def train(cfg: DictConfig) -> float | None:
    """Run one training job; returns ``cfg.monitor`` at the end (for Hydra sweepers)."""
    hc = HydraConfig.get()
    run_dir = Path(cfg.paths.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_root = Path(cfg.paths.log_dir) / cfg.run_name
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)

    # 1. The checkpoint to resume (a bad path fails at once), then data and models. Every
    # ValueError up to the first step is about the user's config, data or checkpoint.
    with input_checks():
        check_config(cfg)
        # half-written checkpoints of runs killed mid-save (each as large as a checkpoint)
        dirs = [*run_root.glob("**/checkpoints"), run_dir / "checkpoints"]
        for f in remove_stale_temporaries(dict.fromkeys(d for d in dirs if d.is_dir())):
            print(f"removed {f}: a partial checkpoint write of a killed run", flush=True)
        ckpt = resolve_ckpt_path(cfg.get("ckpt_path"), run_root, list(hc.overrides.task),
                                 run_dir, strict=bool(cfg.get("resume_strict", False)))
        # read before the target's weights load: a corrupt file fails first
        io = AtomicCheckpointIO(trust=bool(cfg.get("trust_checkpoint", False)))
        raw = io.load_checkpoint(ckpt) if ckpt else {}
        saved = {"dflash": raw.get("dflash")} if ckpt else None
        saved_world, raw = loader_world_size(raw), None
        world = _world_size(cfg.trainer)
        if saved_world is not None and saved_world != world:
            # The data position is per rank and an epoch's optimizer steps (the LR schedule's unit)
            # scale with 1 / world size: neither carries over, and resume is exact or refused.
            raise UserError(
                f"ckpt_path={ckpt}: saved with world size {saved_world}, this run has world size "
                f"{world} (trainer.devices x trainer.num_nodes); resume with "
                f"{saved_world} processes, or start a new run"
            )
        module, dm, total = build_run(cfg)
        if saved is not None:  # fail before training on a checkpoint from another setup
            check_matches(saved, module.checkpoint_meta(), str(ckpt))
            print(f"resuming from {ckpt}", flush=True)

    # 2. Trainer, loggers, callbacks; the resolved config is saved next to the run.
    loggers = build_loggers(cfg.get("logger"), run_dir, ckpt.parent.parent if ckpt else None)
    callbacks = build_callbacks(cfg.get("callbacks"))
    gate = getattr(dm, "feature_gate", None)  # features=vllm_server: rows fetched ahead
    if gate is not None:
        callbacks.append(gate)
    # Atomic checkpoint writes always; config plugins (e.g. SLURMEnvironment) come on top.
    plugins = [hydra.utils.instantiate(p) for p in (cfg.trainer.get("plugins") or [])]
    plugins.append(io)
    tkw = {k: v for k, v in cfg.trainer.items() if k != "plugins"}
    trainer: L.Trainer = hydra.utils.instantiate(
        tkw, logger=loggers or False, callbacks=callbacks, plugins=plugins, _convert_="partial"
    )
    resolved = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k])
                else cfg[k] for k in cfg if k != "hydra"}
    resolved["total_steps"] = total  # optimizer steps the LR/noise/anchor schedules span
    (run_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(resolved))
    if ckpt is not None:
        (run_dir / "resumed_from.txt").write_text(f"{ckpt}\n")
    for lg in loggers:
        lg.log_hyperparams(resolved)
        exp_id = getattr(getattr(lg, "experiment", None), "id", None)
        if "Wandb" in type(lg).__name__ and exp_id:
            (run_dir / "wandb_id.txt").write_text(str(exp_id))

    trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt) if ckpt else None)
    if gate is not None:
        gate.raise_if_failed()  # the servers went away: last.ckpt is the last complete step
    value = trainer.callback_metrics.get(cfg.monitor)
    if value is None and str(cfg.monitor).startswith("val/") and not trainer.interrupted:
        # the run ended before its first validation (e.g. max_steps < an epoch): sweepers
        # still need the objective, so validate the final weights once
        trainer.validate(module, datamodule=dm, verbose=False)
        value = trainer.callback_metrics.get(cfg.monitor)
    if value is None:
        have = sorted(k for k in trainer.callback_metrics if "/" in k)
        print(f"monitor={cfg.monitor!r} was never logged; logged metrics: {have[:20]}", flush=True)
    _finish_wandb(loggers)
    return float(value) if value is not None else None


def _finish_wandb(loggers) -> None:
    """Close the W&B run so the next multirun job starts a fresh one."""
    if any("Wandb" in type(lg).__name__ for lg in loggers):
        import wandb

        wandb.finish()
