"""``features=cache``: run the frozen target once per data row and train from what it saved.

The cache of a split lives in ``<features.dir>/<hash of its fingerprint>/`` (or an explicit
``features.path``). The fingerprint names everything the stored numbers depend on — target
weights, dtype and attention kernel, captured layer ids, tokenizer, data files, length
policy, storage dtype and top-k — so a cache is reused only by runs that would compute the
same features; an explicit path made from anything else is refused before training, naming
what differs.

It is built before training (``python train.py features=cache ...`` builds what is missing,
with a progress bar, then trains; several processes on one machine wait on a file lock for
the first one's build). A separate pass keeps resume and DDP exactly as they are: the
training loop only ever reads finished caches.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from dflash_lit.atomic import remove_stale_temporaries, replace_dir, temporary_name
from dflash_lit.data.features import (
    FORMAT_VERSION,
    FeatureCacheError,
    FeatureStore,
    FeatureWriter,
    check_store_dtype,
    fingerprint_diff,
    read_manifest,
    write_manifest,
)
from dflash_lit.data.shards import find_shards
from dflash_lit.errors import UserError

MODES = ("online", "cache", "vllm", "vllm_server")
CACHED = ("cache", "vllm")  # modes that train from a feature cache on disk


def _file_digest(path: Path, full_limit: int = 1 << 30) -> str:
    """sha256 of a file (files over ``full_limit``: size + first and last 16 MiB)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f:
        if size <= full_limit:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        else:
            h.update(str(size).encode())
            h.update(f.read(16 << 20))
            f.seek(size - (16 << 20))
            h.update(f.read())
    return h.hexdigest()[:16]


def target_fingerprint(tcfg: DictConfig) -> dict[str, Any]:
    """What the target's numbers depend on: weights (or the random build), dtype, kernel."""
    fp: dict[str, Any] = {"dtype": tcfg.get("dtype", "float32"),
                          "attn_implementation": tcfg.get("attn_implementation", "sdpa")}
    if tcfg.get("path"):
        p = Path(tcfg.path)
        files = sorted([*p.glob("*.safetensors"), *p.glob("*.bin"), p / "config.json"])
        fp["weights"] = {f.name: _file_digest(f) for f in files if f.is_file()}
        tok = [p / n for n in ("tokenizer.json", "tokenizer_config.json") if (p / n).is_file()]
        fp["tokenizer"] = {f.name: _file_digest(f) for f in tok}
    else:
        fp["build"] = OmegaConf.to_container(tcfg.build, resolve=True)
    return fp


def build_target_config(cfg: DictConfig) -> DictConfig:
    """The target config a cache is built with: ``target``, run in ``features.target_dtype``
    when that is set (e.g. bfloat16: 2x faster on a CPU with bf16 matmuls; its argmax labels
    are then the bf16 target's)."""
    dtype = cfg.features.get("target_dtype")
    if dtype is None:
        return cfg.target
    tcfg = cfg.target.copy()
    tcfg.dtype = str(dtype)
    return tcfg


def split_fingerprint(cfg: DictConfig, data_path: str, capture_ids: list[int],
                      topk: int, target_fp: dict[str, Any] | None = None) -> dict[str, Any]:
    """The full fingerprint of one split's cache (``target_fp``: the target's, if known)."""
    files = find_shards(data_path)
    return {
        "format": FORMAT_VERSION,
        "target": target_fp if target_fp is not None else target_fingerprint(
            build_target_config(cfg)),
        "layer_ids": list(capture_ids),
        "data": {f.name: _file_digest(f) for f in files},
        "max_length": int(cfg.data.max_length),
        "overlength": str(cfg.data.overlength),
        "dtype": str(cfg.features.dtype),
        "topk": int(topk),
    }


def _hash(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


@contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cache_needs_distribution(losses: dict[str, Any]) -> bool:
    """Whether a feature cache must store the target's top-k logits for these losses
    (drafter name -> configured loss): a distillation loss needs them, hard CE and D-PACE the
    argmax only. A loss that needs the full distribution (e.g. reverse KL) is refused."""
    for name, loss in losses.items():
        if loss.needs_full_distribution:
            raise UserError(f"drafters.{name}.{loss.full_distribution_reason}: use "
                            "features=online, or a loss that a top-k cache can serve")
    return any(loss.needs_target_distribution for loss in losses.values())


def resolve_topk(fcfg: DictConfig, need_distribution: bool) -> int:
    """Top-k logits to store: ``features.topk`` or, when null, 64 if a loss needs the target's
    distribution (composite / distill) and 0 otherwise (hard CE and D-PACE need the argmax
    only)."""
    k = fcfg.get("topk")
    if k is None:
        return 64 if need_distribution else 0
    if int(k) < 0 or (need_distribution and int(k) == 0):
        raise FeatureCacheError(
            f"features.topk={k}: a loss here needs the target's distribution (composite / "
            "distill); store its top-k logits (features.topk=64) or use features=online")
    return int(k)


def check_features_config(fcfg: DictConfig, tcfg: DictConfig | None = None) -> str:
    """``features.mode``, after checking the keys that mode reads."""
    mode = str(fcfg.get("mode", "online"))
    if mode not in MODES:
        raise FeatureCacheError(f"features.mode={mode!r}: use one of {list(MODES)}")
    if mode in (*CACHED, "vllm_server"):
        check_store_dtype(str(fcfg.dtype))
    if mode == "cache" and int(fcfg.batch_tokens) < 1:
        raise FeatureCacheError(f"features.batch_tokens={fcfg.batch_tokens} must be >= 1")
    if mode == "vllm":
        if int(fcfg.part_mb) < 1:
            raise UserError(f"features.part_mb={fcfg.part_mb}: must be >= 1")
    if mode in ("vllm", "vllm_server"):
        if tcfg is not None and not tcfg.get("path"):
            raise UserError(f"features={mode}: the engine serves a model directory; set "
                            "target.path (a random target.build has none) or use features=cache")
        for key in ("tensor_parallel_size", "data_parallel_size", "max_num_seqs"):
            if int(fcfg.engine[key]) < 1:
                raise UserError(f"features.engine.{key}={fcfg.engine[key]}: must be >= 1")
        if not 0 < float(fcfg.engine.memory_fraction) < 1:
            raise UserError(f"features.engine.memory_fraction={fcfg.engine.memory_fraction}: the "
                            "share of memory vLLM reserves (RAM on CPU), in (0, 1), e.g. 0.2")
    return mode


def ensure_cache(cfg: DictConfig, dataset, data_path: str, what: str, capture_ids: list[int],
                 topk: int, build, target_fp: dict[str, Any] | None = None,
                 engine_fp: dict[str, Any] | None = None) -> FeatureStore:
    """The finished cache of ``dataset`` (built now when missing); refuses a stale one.

    ``build(dataset, out, fingerprint, what)`` is called only when a build is needed;
    ``engine_fp`` names the serving engine that builds it (``features=vllm``), if any.
    """
    fp = split_fingerprint(cfg, data_path, capture_ids, topk, target_fp)
    if engine_fp is not None:
        fp["engine"] = engine_fp
    fcfg = cfg.features
    split = "val" if what == "data.val_path" else "train"
    out = Path(fcfg.path) / split if fcfg.get("path") else Path(fcfg.dir) / _hash(fp)
    with _lock(out.parent / f".{out.name}.lock"):
        manifest = read_manifest(out)
        if manifest is not None:
            diff = fingerprint_diff(manifest.get("fingerprint", {}), fp)
            if diff:
                raise FeatureCacheError(
                    f"feature cache {out} (for {what}) was made from other inputs: {diff} "
                    "differ; delete it, point features.path elsewhere, or drop features.path "
                    "to get a cache per fingerprint")
            store = FeatureStore(out)
            _check_covers(store, dataset, out, what)
            return store
        if out.exists():  # a build killed part-way: nothing in it is trusted
            shutil.rmtree(out)
        build(dataset, out, fp, what)
    return FeatureStore(out)


def _check_covers(store: FeatureStore, dataset, out: Path, what: str) -> None:
    """Refuse, before training, a cache that lacks rows this run keeps: the length policy's
    row filter (``data.min_completion_tokens``, 2 × block_size when null) is not part of the
    fingerprint, so a run that keeps more rows than the build did finds them missing."""
    missing = store.uncovered(dataset.rows, dataset.lengths)
    if missing:
        raise FeatureCacheError(
            f"feature cache {out} (for {what}) holds no features for {len(missing)} of the "
            f"{len(dataset)} rows this run keeps (e.g. data row {missing[0]}): it was built "
            "for a run that dropped them (data.min_completion_tokens defaults to 2 x "
            "drafter.block_size); set data.min_completion_tokens to the build's value (32 for "
            "block_size 16) or delete the cache to rebuild")


def build_cache(target, dataset, out: Path, fp: dict[str, Any], batch_tokens: int, topk: int,
                what: str = "data") -> None:
    """Run ``target`` over every row of ``dataset`` (length-sorted batches of at most
    ``batch_tokens`` padded tokens) and write the cache to ``out`` (atomically renamed)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from dflash_lit.data.collate import PadCollator

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries([out.parent])  # a killed build's partial cache
    tmp = temporary_name(out)
    shutil.rmtree(tmp, ignore_errors=True)
    order = np.argsort(dataset.lengths, kind="stable")
    batches, cur = [], []
    for i in order.tolist():
        n = int(dataset.lengths[i])
        if cur and (len(cur) + 1) * max(n, int(dataset.lengths[cur[-1]])) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    collate = PadCollator(0)
    writer = FeatureWriter(tmp, len(target.layer_ids) * target.hidden_size, fp["dtype"], topk)
    t0 = time.time()
    with Progress(TextColumn(f"target features ({what})"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} rows"), TimeRemainingColumn()) as bar:
        task = bar.add_task("rows", total=len(dataset))
        for idx in batches:
            batch = collate(dataset.__getitems__(idx))
            am = batch["attention_mask"].to(target.device)
            o = target(batch["input_ids"].to(target.device), attention_mask=am, need_logits=True)
            lens = batch["lengths"].tolist()
            hid = [o.hidden[j, :n] for j, n in enumerate(lens)]
            arg = [o.logits[j, :n].argmax(-1) for j, n in enumerate(lens)]
            tk_i = tk_v = None
            if topk:
                top = [o.logits[j, :n].float().topk(topk, dim=-1) for j, n in enumerate(lens)]
                tk_i, tk_v = [t.indices for t in top], [t.values for t in top]
            writer.add([int(dataset.rows[i]) for i in idx], hid, arg, tk_i, tk_v)
            bar.advance(task, len(idx))
    writer.close()
    write_manifest(tmp, fp, {"rows": writer.rows, "tokens": writer.tokens,
                             "feature_dim": writer.feature_dim,
                             "bytes": sum(f.stat().st_size for f in tmp.glob("part-*.arrow")),
                             "build_s": round(time.time() - t0, 1)})
    replace_dir(tmp, out)
    print(f"feature cache for {what}: {writer.rows} rows, {writer.tokens} tokens -> {out}",
          flush=True)


def attach_feature_caches(cfg: DictConfig, dm, capture_ids: list[int],
                          need_distribution: bool, load_target,
                          target_shape: tuple[int, int] | None = None) -> dict[str, FeatureStore]:
    """Build (if needed) and attach the caches of the datamodule's train and val rows:
    by ``load_target()``'s HF forward (``features=cache``) or by vLLM (``features=vllm``; then
    ``target_shape`` = (num_layers, hidden_size) of the target)."""
    topk = resolve_topk(cfg.features, need_distribution)
    target_holder: list[Any] = []
    engine_fp = None
    if cfg.features.mode == "vllm":
        from dflash_lit.data.vllm_features.build import build_cache_vllm, engine_fingerprint

        assert target_shape is not None
        engine_fp = engine_fingerprint(cfg.features.engine,
                                       str(build_target_config(cfg).get("dtype", "float32")))

        def build(dataset, out, fp, what):
            build_cache_vllm(cfg, dataset, out, fp, topk, capture_ids, *target_shape, what)
    else:
        def build(dataset, out, fp, what):
            if not target_holder:
                target_holder.append(load_target())
            build_cache(target_holder[0], dataset, out, fp, int(cfg.features.batch_tokens),
                        topk, what)

    stores = {}
    has_val = dm.val_dataset is not None and len(dm.val_dataset) > 0
    separate_val = bool(cfg.data.get("val_path"))
    # a validation split of data.path shares its cache: build it over both parts' rows
    rows = dm.train_dataset if separate_val or not has_val else \
        _union(dm.train_dataset, dm.val_dataset)
    target_fp = target_fingerprint(build_target_config(cfg))  # once for both splits
    stores["train"] = ensure_cache(cfg, rows, cfg.data.path, "data.path", capture_ids, topk,
                                   build, target_fp, engine_fp)
    dm.train_dataset.features = stores["train"]
    if has_val:
        dm.val_dataset.features = stores["val"] = ensure_cache(
            cfg, dm.val_dataset, cfg.data.val_path, "data.val_path", capture_ids, topk, build,
            target_fp, engine_fp) if separate_val else stores["train"]
    if target_holder:
        del target_holder[0]  # free the decoder layers: training reads only the caches
    return stores


def _union(a, b):
    """One dataset holding the rows of two views of the same shards."""
    from dflash_lit.data.shards import ShardDataset

    return ShardDataset(a._parts, a.files, np.concatenate([a.rows, b.rows]),
                        np.concatenate([a.lengths, b.lengths]))
