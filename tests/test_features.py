"""Cached target features (features=cache): the same training as online, a stale cache
refused before training, exact resume from the cache, no decoder layers loaded."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from train_utils import base_overrides, drafter_state, make_shards, run_train

from dflash_lit.data.features import FeatureCacheError, FeatureStore
from dflash_lit.errors import UserError


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fdata")
    return make_shards(root / "train", n=24), make_shards(root / "val", n=6, seed=1)


def _losses(run_dir: Path, key: str = "train/main/loss") -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}


def _ov(tmp: Path, data, *extra: str) -> list[str]:
    train, val = data
    return base_overrides(tmp, train, val) + ["experiment=v5_hardce", "trainer.max_steps=6",
                                              "schedule.noise.peak=0.05", *extra]


def test_cache_trains_like_online(tmp_path, data):
    """fp32 cache: every step's loss and the final weights equal the online run's within
    1e-5 (the cache's target forward batches rows differently, which moves fp32 sums in the
    last bits); bf16 storage (the default) stays within 1e-2 of the loss."""
    run_train(_ov(tmp_path, data), tmp_path / "online")
    run_train(_ov(tmp_path, data, "features=cache", "features.dtype=float32"),
              tmp_path / "cache32")
    run_train(_ov(tmp_path, data, "features=cache"), tmp_path / "cache16")
    on, c32, c16 = (_losses(tmp_path / n) for n in ("online", "cache32", "cache16"))
    assert sorted(on) == sorted(c32) == sorted(c16) == list(range(6))
    for s in on:
        assert abs(on[s] - c32[s]) <= 1e-5 * max(1.0, abs(on[s])), (s, on[s], c32[s])
        assert abs(on[s] - c16[s]) <= 1e-2 * max(1.0, abs(on[s])), (s, on[s], c16[s])
    a = drafter_state(tmp_path / "online" / "checkpoints" / "last.ckpt")
    b = drafter_state(tmp_path / "cache32" / "checkpoints" / "last.ckpt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    # one cache per fingerprint: fp32 and bf16 runs made two, each holding train + val
    caches = sorted(p for p in (tmp_path / "outputs" / "features").iterdir() if p.is_dir())
    assert len(caches) == 4
    store = FeatureStore(caches[0])
    assert len(store) in (24, 6) and store.feature_dim == 4 * 64


def test_stale_cache_is_refused_before_training(tmp_path, data):
    fixed = tmp_path / "fixed_cache"
    run_train(_ov(tmp_path, data, "features=cache", f"features.path={fixed}",
                  "trainer.max_steps=1"), tmp_path / "first")
    assert (fixed / "train" / "manifest.json").is_file()
    for extra, what in [("drafter.drop_last_context_layers=0", "layer_ids"),
                        ("target.build.seed=1", "target"),
                        ("data.max_length=100", "max_length")]:
        with pytest.raises((FeatureCacheError, UserError), match=what):
            run_train(_ov(tmp_path, data, "features=cache", f"features.path={fixed}", extra),
                      tmp_path / f"stale_{what}")
        assert not (tmp_path / f"stale_{what}" / "checkpoints").exists()


def test_a_cache_missing_rows_the_run_keeps_is_refused_before_training(tmp_path, data):
    """The row filter (data.min_completion_tokens) is not in the fingerprint: a run keeping
    rows the build dropped gets a one-line error naming the key, not a failure mid-epoch."""
    fixed = tmp_path / "fixed_cache"
    run_train(_ov(tmp_path, data, "features=cache", f"features.path={fixed}",
                  "data.min_completion_tokens=70", "trainer.max_steps=1"), tmp_path / "first")
    kept = len(FeatureStore(fixed / "train"))
    assert 0 < kept < 24
    with pytest.raises((FeatureCacheError, UserError), match=rf"holds no features for {24 - kept} of the 24 "
                       r"rows .*set data.min_completion_tokens"):
        run_train(_ov(tmp_path, data, "features=cache", f"features.path={fixed}"),
                  tmp_path / "more_rows")
    assert not (tmp_path / "more_rows" / "checkpoints").exists()


def test_resume_from_cache_is_exact(tmp_path, data):
    ov = _ov(tmp_path, data, "features=cache", "trainer.max_steps=7",
             "callbacks.model_checkpoint.every_n_train_steps=3")
    run_train(ov, tmp_path / "straight")
    mid = tmp_path / "straight" / "checkpoints" / "step0000003.ckpt"
    run_train(ov + [f"ckpt_path={mid}"], tmp_path / "resumed")
    a = drafter_state(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    b = drafter_state(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    la, lb = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert all(la[s] == lb[s] for s in lb)


def test_cache_mode_loads_no_decoder_layers(tmp_path, data):
    from train_utils import compose_train

    from dflash_lit.model.target import TargetHeads
    from dflash_lit.train.run import build_run

    cfg = compose_train(_ov(tmp_path, data, "features=cache"), tmp_path / "r")
    module, dm, _ = build_run(cfg)
    assert isinstance(module.target, TargetHeads)
    # embed_tokens + lm_head (untied in this random target), nothing else
    assert sum(p.numel() for p in module.target.parameters()) == 2 * 128 * 64
    batch = next(iter(dm.train_dataloader()))
    assert batch["target_hidden"].shape[-1] == 4 * 64
    assert batch["target_argmax"].shape == batch["input_ids"].shape


def test_cache_built_in_another_dtype_is_its_own_cache(tmp_path, data):
    """features.target_dtype=bfloat16 builds with a bf16 target (its own fingerprint, the
    training heads stay target.dtype); its labels are the bf16 target's argmax."""
    import json

    from train_utils import compose_train

    from dflash_lit.train.build import build_target
    from dflash_lit.train.feature_cache import build_target_config
    from dflash_lit.train.run import build_run

    cfg = compose_train(_ov(tmp_path, data, "features=cache", "features.target_dtype=bfloat16"),
                        tmp_path / "r")
    module, dm, _ = build_run(cfg)
    assert module.target.lm_head.weight.dtype == torch.float32  # target.dtype
    manifests = [json.loads(p.read_text()) for p in
                 (tmp_path / "outputs" / "features").glob("*/manifest.json")]
    assert {m["fingerprint"]["target"]["dtype"] for m in manifests} == {"bfloat16"}
    batch = next(iter(dm.train_dataloader()))
    assert build_target_config(cfg).dtype == "bfloat16" and cfg.target.dtype == "float32"
    target = build_target(build_target_config(cfg), module.capture_ids)
    out = target(batch["input_ids"], attention_mask=batch["attention_mask"], need_logits=True)
    am = batch["attention_mask"].bool()
    # (the build batched these rows with other padding: bf16 sums may differ in the last bit)
    same = (batch["target_argmax"][am] == out.logits.argmax(-1)[am]).float().mean()
    assert same >= 0.98
    # the stored features are the bf16 target's, not the float32 one's rounded to bf16
    fp32 = build_target(cfg.target, module.capture_ids)(
        batch["input_ids"], attention_mask=batch["attention_mask"]).hidden
    cached = batch["target_hidden"][am].float()
    err_bf16 = (cached - out.hidden[am].float()).abs().mean()
    err_fp32 = (cached - fp32[am].float()).abs().mean()
    assert err_bf16 < err_fp32 / 4
