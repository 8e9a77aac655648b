"""``features=vllm_server``: training from feature servers (``serve_features.py``).

Before training every server in ``features.urls`` is asked what it computes
(``/dflash/info``) and refused, in one line, if that is not what this run needs (another
target's weights or tokenizer, other layer ids, another dtype or top-k). During training
:class:`FeatureServerGate` keeps ``features.ahead`` batches requested ahead of the data
position (the sampler's next batches, so a resumed run asks for exactly what it will read) and,
at each step boundary, waits for the next batch's rows: when the servers stay down past the
retries, it saves ``last.ckpt`` right there — the last complete step — and stops the run,
which then ends with one line saying how to resume.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig

from dflash_lit.data.vllm_features.client import FeatureClient, FeatureServerError, ServerFeatures
from dflash_lit.errors import UserError
from dflash_lit.lifetime import engine_env
from dflash_lit.train.checkpointing import checkpoint_dir
from dflash_lit.train.feature_cache import build_target_config, target_fingerprint


def served_fingerprint(cfg: DictConfig, layer_ids: list[int], topk: int) -> dict[str, Any]:
    """What a feature server for this run must compute (compared with its ``/dflash/info``)."""
    target = target_fingerprint(build_target_config(cfg))
    target.pop("attn_implementation", None)  # an HF setting; the engine has its own kernels
    return {"target": target, "layer_ids": [int(i) for i in layer_ids],
            "dtype": str(cfg.features.dtype), "topk": int(topk)}


def check_servers(client: FeatureClient, want: dict[str, Any]) -> list[dict[str, Any]]:
    """Every server's info; one line for the first one unreachable or computing otherwise."""
    infos = []
    for url in client.urls:
        info = client.info(url)
        have = info.get("fingerprint", {})
        diff = sorted(k for k in want if have.get(k) != want[k])
        if diff:
            raise UserError(
                f"features.urls: {url} serves other features than this run needs ({', '.join(diff)}"
                f" differ: server {({k: have.get(k) for k in diff})} vs run "
                f"{({k: want[k] for k in diff})}); start it with this run's overrides")
        infos.append(info)
    return infos


def attach_feature_servers(cfg: DictConfig, dm, layer_ids: list[int], topk: int,
                           hidden_size: int) -> FeatureServerGate:
    """Attach the servers' features to the datamodule's splits; the gate callback to train with."""
    fcfg = cfg.features
    if int(cfg.data.get("num_workers", 0)) != 0:
        raise UserError(f"data.num_workers={cfg.data.num_workers}: features=vllm_server fetches "
                        "ahead in the main process (features.ahead batches); set data.num_workers=0")
    client = FeatureClient(list(fcfg.urls), float(fcfg.timeout_s), int(fcfg.retries),
                           float(fcfg.retry_wait_s))
    infos = check_servers(client, served_fingerprint(cfg, layer_ids, topk))
    engines = sorted({f"{i.get('engine', {}).get('name')} {i.get('engine', {}).get('version')}"
                      for i in infos})
    print(f"feature servers: {len(infos)} ({', '.join(client.urls)}; {', '.join(engines)})",
          flush=True)
    features = ServerFeatures(client, len(layer_ids) * hidden_size, str(fcfg.dtype), topk,
                              int(fcfg.workers))
    dm.train_dataset.features = features
    if dm.val_dataset is not None:
        dm.val_dataset.features = features
    return FeatureServerGate(features, int(fcfg.ahead))


class FeatureServerGate(Callback):
    """Requests rows ahead of the data position; saves and stops at a step boundary when the
    next batch's rows cannot be had (see the module docstring)."""

    def __init__(self, features: ServerFeatures, ahead: int, filename: str = "last.ckpt") -> None:
        self.features, self.ahead, self.filename = features, max(1, int(ahead)), filename
        self.failure: str | None = None

    def _schedule(self, trainer) -> list[int]:
        """Request the rows of the next ``ahead`` batches not yet requested; the next batch's
        rows."""
        dm = trainer.datamodule
        batches = dm.train_sampler.upcoming(self.ahead)
        ds = dm.train_dataset
        pos = list(dict.fromkeys(i for b in batches for i in b))
        rows = ds.rows[np.asarray(pos, np.int64)].tolist()
        new = [(p, r) for p, r in zip(pos, rows) if not self.features.has(r)]
        if new:
            self.features.schedule([r for _, r in new], ds.token_ids([p for p, _ in new]))
        return ds.rows[np.asarray(batches[0], np.int64)].tolist() if batches else []

    def on_train_start(self, trainer, pl_module) -> None:
        self._schedule(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rows = self._schedule(trainer)
        err = self.features.wait(rows) if not self._last_step(trainer) else None
        flag = trainer.strategy.reduce_boolean_decision(err is not None, all=False)
        if not flag:
            return
        path = checkpoint_dir(trainer) / self.filename
        trainer.save_checkpoint(str(path))
        self.failure = (f"{err or 'another rank lost its feature servers'}; saved {path} at step "
                        f"{trainer.global_step} (the last complete step): resume with "
                        "ckpt_path=last once a server is back")
        rank_zero_info(self.failure)
        trainer.should_stop = True

    @staticmethod
    def _last_step(trainer) -> bool:
        if trainer.max_steps and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            return True
        loop = trainer.fit_loop
        return (trainer.max_epochs is not None and loop.epoch_progress.current.completed + 1 >=
                trainer.max_epochs and trainer.datamodule.train_sampler.batches_consumed >=
                len(trainer.datamodule.train_sampler))

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise FeatureServerError(self.failure)


def serve(cfg: DictConfig) -> int:
    """``serve_features.py``: run vLLM as a feature server for the run ``cfg`` describes (its
    target, the drafters' layer ids, the losses' top-k); returns vLLM's exit code."""
    import json
    import os
    import shutil
    import subprocess
    from pathlib import Path

    from dflash_lit.data.vllm_features.build import engine_fingerprint
    from dflash_lit.data.vllm_features.connector import write_info
    from dflash_lit.data.vllm_features.rows import capture_ids
    from dflash_lit.data.vllm_features.server import SPOOL_ENV, TTL_ENV, WAIT_ENV, server_command
    from dflash_lit.train.build import build_specs, target_info
    from dflash_lit.train.feature_cache import (
        cache_needs_distribution,
        check_features_config,
        resolve_topk,
    )
    from dflash_lit.train.losses import build_loss
    from dflash_lit.train.spec import capture_layer_ids

    if check_features_config(cfg.features, cfg.target) != "vllm_server":
        raise UserError("serve_features.py serves features=vllm_server: add features=vllm_server")
    info = target_info(cfg.target)
    specs = build_specs(cfg, info)
    layer_ids = capture_layer_ids(specs)
    need_dist = cache_needs_distribution({s.name: build_loss(**s.loss) for s in specs})
    topk = resolve_topk(cfg.features, need_dist)
    fcfg, ecfg = cfg.features, cfg.features.engine
    dtype = str(build_target_config(cfg).get("dtype", "float32"))
    spool = Path(fcfg.serve.spool)
    shutil.rmtree(spool, ignore_errors=True)  # rows of an earlier server nobody will fetch
    target = str(Path(cfg.target.path).resolve())
    write_info(spool, {"fingerprint": served_fingerprint(cfg, layer_ids, topk),
                       "engine": engine_fingerprint(ecfg, dtype)})
    connector = {"target": target, "layer_ids": layer_ids, "num_layers": info["num_layers"],
                 "dtype": dtype, "store_dtype": str(fcfg.dtype), "topk": topk, "sink": "spool",
                 "dir": str(spool)}
    engine = {k: ecfg[k] for k in ecfg}
    engine["max_model_len"] = ecfg.max_model_len or int(cfg.data.max_length) + 1
    cmd = server_command(target, connector, capture_ids(layer_ids, info["num_layers"]), dtype,
                         str(fcfg.serve.host), int(fcfg.serve.port), engine)
    env = engine_env({**os.environ, SPOOL_ENV: str(spool), WAIT_ENV: str(fcfg.serve.wait_s),
                      TTL_ENV: str(fcfg.serve.ttl_s),
                      "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")})
    print(f"feature server for layers {layer_ids} (top-k {topk}, {fcfg.dtype}) of {target} on "
          f"http://{fcfg.serve.host}:{fcfg.serve.port}", flush=True)
    print(json.dumps(cmd), flush=True)
    return subprocess.call(cmd, env=env)
