"""End-to-end training: exact resume, checkpoint contents, experiments, sweeps, bad input."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_utils import (
    REPO,
    base_overrides,
    compose_train,
    drafter_state,
    make_shards,
    run_train,
    state_digest,
)

from dflash_lit.errors import UserError


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return make_shards(root / "train", n=40), make_shards(root / "val", n=6, seed=1)


def _metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_resume_is_bit_exact_three_drafters_mid_epoch(tmp_path, data):
    """N+M straight == N, stop, resume, M — three drafters, ramped anchors and noise active."""
    train, val = data
    ov = base_overrides(tmp_path, train, val) + [
        "experiment=multi_drafter",
        "trainer.max_steps=9",
        "callbacks.model_checkpoint.every_n_train_steps=4",
        "schedule.noise.peak=0.05",
        "schedule.noise.final=0.01",
        "schedule.noise.warmup_frac=0.3",
        "schedule.anchors.start=2",
        "schedule.anchors.ramp_frac=0.8",
        "optim.warmup_frac=0.2",
    ]
    run_train(ov, tmp_path / "straight")
    ckpts = tmp_path / "straight" / "checkpoints"
    mid = ckpts / "step0000004.ckpt"
    assert mid.is_file(), sorted(p.name for p in ckpts.iterdir())
    meta = torch.load(mid, map_location="cpu", weights_only=True)
    progress = meta["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    # the cut is inside epoch 0, not on its boundary: 4 batches in, more to come
    assert meta["epoch"] == 0 and progress["current"]["ready"] == 4
    assert not progress["is_last_batch"]
    run_train(ov + [f"ckpt_path={mid}"], tmp_path / "resumed")
    a = drafter_state(ckpts / "last.ckpt")
    b = drafter_state(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert sorted({k.split(".")[1] for k in a}) == ["gamma10", "gamma4", "gamma7"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # every drafter's Adam moments continue exactly too
    oa = torch.load(ckpts / "last.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    ob = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt",
                    weights_only=True)["optimizer_states"][0]["state"]
    assert oa.keys() == ob.keys() and len(oa) == len(a)
    for i in oa:
        assert torch.equal(oa[i]["exp_avg"], ob[i]["exp_avg"])
        assert torch.equal(oa[i]["exp_avg_sq"], ob[i]["exp_avg_sq"])
    # logged curves continue: steps 4.. of the resumed run equal the straight run's
    sa = {r["step"]: r["train/gamma7/loss"] for r in _metrics(tmp_path / "straight")
          if r.get("train/gamma7/loss")}
    sb = {r["step"]: r["train/gamma7/loss"] for r in _metrics(tmp_path / "resumed")
          if r.get("train/gamma7/loss")}
    assert min(int(s) for s in sb) == 4
    assert all(sa[s] == sb[s] for s in sb)


def test_checkpoint_holds_drafters_and_optimizer_not_target(tmp_path, data):
    train, val = data
    ov = base_overrides(tmp_path, train, val) + ["experiment=multi_drafter", "trainer.max_steps=2"]
    run_train(ov, tmp_path / "run")
    ck = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    keys = ck["state_dict"].keys()
    assert all(k.startswith(("drafters.", "train_metrics.", "val_metrics.", "val_plateau."))
               for k in keys)
    assert not any("embed_tokens" in k or "lm_head" in k or k.startswith("model.") for k in keys)
    opt = ck["optimizer_states"][0]
    names = [g["name"] for g in opt["param_groups"]]
    assert names == ["gamma4", "gamma7", "gamma10"]
    n_params = sum(1 for k in keys if k.startswith("drafters."))
    assert len(opt["state"]) == n_params  # moments for every parameter of every drafter
    assert set(ck["dflash"]["drafters"]) == {"gamma4", "gamma7", "gamma10"}
    assert ck["dflash"]["drafters"]["gamma4"]["loss"]["gamma"] == 4.0
    assert ck["dflash"]["target"]["hidden_size"] == 64


@pytest.mark.parametrize("exp", ["v3_composite", "v4_5layer", "v5_hardce", "v6_muon",
                                 "multi_drafter"])
def test_experiments_compose_and_run(tmp_path, data, exp):
    train, val = data
    ov = base_overrides(tmp_path, train, val) + [f"experiment={exp}", "debug=fast_dev_run"]
    _, cfg = run_train(ov, tmp_path / exp)
    if exp in ("v3_composite", "v5_hardce", "v6_muon"):
        assert cfg.drafter.drop_last_context_layers == 1
    assert cfg.optim.name == ("muon" if exp == "v6_muon" else "adamw")
    if exp == "v4_5layer":
        assert cfg.drafter.drop_last_context_layers == 0
        assert (cfg.loss.name, cfg.loss.divergence, cfg.loss.div_weight) == ("distill",
                                                                           "forward_kl", 0.7)
        assert cfg.schedule.noise.peak == 0.01  # (anchors.max=1024 is overridden by the test)


def test_loss_falls_and_acc_rises(tmp_path, data):
    """A real (if tiny) learning signal: stride-1 progressions, a target with larger init so
    its frozen lm_head can express confident logits within 40 steps."""
    _, val = data
    train = make_shards(tmp_path / "easy", n=40, max_stride=1)
    ov = base_overrides(tmp_path, train, val) + [
        "experiment=v5_hardce", "loss.labels=data", "trainer.max_steps=40",
        "optim.lr=3e-3", "schedule.anchors.max=16", "+target.build.initializer_range=0.3",
    ]
    run_train(ov, tmp_path / "run")
    rows = [r for r in _metrics(tmp_path / "run") if r.get("train/main/loss")]
    loss = [float(r["train/main/loss"]) for r in rows]
    acc = [float(r["train/main/acc"]) for r in rows]
    assert len(loss) == 40
    assert sum(loss[-5:]) / 5 < 0.8 * sum(loss[:5]) / 5
    assert sum(acc[-10:]) / 10 > 1.5 * sum(acc[:10]) / 10


def test_ckpt_path_last_picks_newest_matching_run(tmp_path, data):
    from dflash_lit.train.resume import resolve_ckpt_path

    train, val = data
    ov = base_overrides(tmp_path, train, val) + ["trainer.max_steps=2"]
    run_train(ov, tmp_path / "outputs" / "dflash" / "a")
    run_train(ov + ["seed=1"], tmp_path / "outputs" / "dflash" / "b")  # other job
    root = tmp_path / "outputs" / "dflash"
    got = resolve_ckpt_path("last", root, ov + ["ckpt_path=last"], root / "new")
    assert got == root / "a" / "checkpoints" / "last.ckpt"
    # a run directory with its own last.ckpt (a relaunch in a fixed hydra.run.dir) continues it
    assert resolve_ckpt_path("last", root, ov, root / "b") == root / "b" / "checkpoints" / "last.ckpt"
    # nothing to resume: a fresh start, or an error when strict
    assert resolve_ckpt_path("last", root, ov + ["seed=7"], root / "new") is None
    with pytest.raises(UserError, match=r"no checkpoints/last.ckpt in the run directory .*new nor "
                                        r"in an earlier run .*resume_strict=true"):
        resolve_ckpt_path("last", root, ov + ["seed=7"], root / "new", strict=True)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        resolve_ckpt_path(str(tmp_path / "nope.ckpt"), root, ov, root / "new")


def test_resume_with_other_drafter_shape_fails_before_training(tmp_path, data):
    train, val = data
    ov = base_overrides(tmp_path, train, val) + ["trainer.max_steps=2"]
    run_train(ov, tmp_path / "a")
    ck = tmp_path / "a" / "checkpoints" / "last.ckpt"
    with pytest.raises(ValueError, match=r"intermediate_size=96 in the checkpoint but 64"):
        run_train(ov + ["drafter.intermediate_size=64", f"ckpt_path={ck}"], tmp_path / "b")
    with pytest.raises(ValueError, match="block_size=8 in the checkpoint but 4"):
        run_train(ov + ["drafter.block_size=4", f"ckpt_path={ck}"], tmp_path / "c")


def test_bad_data_errors_before_model_loads(tmp_path, data):
    from dflash_lit.data.shards import write_shards

    train, val = data
    ov = base_overrides(tmp_path, train, val)
    with pytest.raises(ValueError, match="data.path: .* does not exist"):
        run_train(ov + [f"data.path={tmp_path}/missing"], tmp_path / "r1")
    bad = tmp_path / "bad_vocab"
    write_shards([{"id": "x", "source": "s", "input_ids": [5] * 40 + [500],
                   "loss_mask": [1] * 41}], bad)
    with pytest.raises(ValueError, match="500"):
        run_train(ov + [f"data.path={bad}"], tmp_path / "r2")


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=600)


def test_cli_multirun_and_unknown_key(tmp_path, data):
    train, val = data
    ov = base_overrides(tmp_path, train, val) + ["debug=fast_dev_run"]
    r = _cli(["-m", *ov, "loss.gamma=4,7"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted((tmp_path / "outputs" / "dflash").glob("multirun_*/*/.hydra/overrides.yaml"))
    assert len(jobs) == 2
    assert not any(p.name not in ("outputs",) for p in tmp_path.iterdir())  # nothing else written
    r = _cli([*ov, "trainer.no_such_key=1"], tmp_path)
    assert r.returncode != 0 and "no_such_key" in r.stderr


def test_hybrid_gated_deltanet_target_trains(tmp_path, data):
    """The Qwen3.5-style hybrid path (Gated DeltaNet + full attention, torch fallback on CPU)
    trains end to end: finite losses every step and a checkpoint that records the hybrid target."""
    train, val = data
    ov = base_overrides(tmp_path, train, val) + ["target=random_hybrid", "trainer.max_steps=3"]
    run_train(ov, tmp_path / "run")
    rows = [r for r in _metrics(tmp_path / "run") if r.get("train/main/loss")]
    assert len(rows) == 3 and all(0 < float(r["train/main/loss"]) < 20 for r in rows)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    meta = torch.load(ckpt, map_location="cpu", weights_only=True)["dflash"]
    assert meta["target"]["model_type"].startswith("qwen3_5")


def test_anchor_scale_of_the_tiny_budget(tmp_path, data):
    """budget=tiny scales every drafter's recipe anchors by 1/16 (v4: 1024 -> 64); full keeps them."""
    from train_utils import compose_train

    from dflash_lit.train.build import build_specs, target_info

    ov = [o for o in base_overrides(tmp_path, *data) if not o.startswith(("budget=", "schedule."))]
    for budget, want in (("tiny", 64), ("full", 1024)):
        cfg = compose_train(ov + ["experiment=v4_5layer", f"budget={budget}"], tmp_path / budget)
        specs = build_specs(cfg, target_info(cfg.target))
        assert specs[0].anchors.max == want


def test_epoch_padding_efficiency_is_logged_and_matches_the_batches(tmp_path, data):
    """perf/epoch_padding_eff (the sampler's plan for the epoch) equals the cumulative real /
    padded tokens the throughput monitor counted over that epoch's actual batches."""
    train, val = data
    ov = base_overrides(tmp_path, train, val) + [
        "trainer.max_epochs=1", "trainer.limit_val_batches=0",
        "+callbacks.throughput._target_=dflash_lit.train.callbacks.ThroughputMonitor",
    ]
    run_train(ov, tmp_path / "run")
    rows = [r for r in _metrics(tmp_path / "run") if r.get("perf/epoch_padding_eff")]
    assert len(rows) > 3
    planned = {float(r["perf/epoch_padding_eff"]) for r in rows}
    assert len(planned) == 1 and 0.5 < planned.pop() <= 1.0
    last = rows[-1]
    assert float(last["perf/padding_eff"]) == pytest.approx(float(last["perf/epoch_padding_eff"]))


def test_monitor_is_returned_even_when_training_ends_before_validation(tmp_path, data):
    """Sweepers need the objective: a run shorter than an epoch validates its final weights."""
    train, val = data
    value, _ = run_train(base_overrides(tmp_path, train, val) + ["trainer.max_steps=2"],
                         tmp_path / "run")
    assert isinstance(value, float) and 0.0 <= value <= 7.0  # val/main/streak of Bs=8 blocks


def test_nonfinite_target_states_are_skipped_then_stop_the_run(tmp_path, data):
    """A target whose weights overflow (initializer_range 1e30 -> inf/NaN hidden states): every
    step is skipped and counted, and the run stops after max_nonfinite_in_row with the reason."""
    train, val = data
    ov = base_overrides(tmp_path, train, val) + [
        "trainer.max_steps=20", "max_nonfinite_in_row=3", "+target.build.initializer_range=1e30"]
    with pytest.raises(FloatingPointError, match=r"3 non-finite steps in a row .*max_nonfinite_in_row=3"):
        run_train(ov, tmp_path / "run")
    rows = [r for r in _metrics(tmp_path / "run") if r.get("train/nonfinite_skipped")]
    # the counter is logged per skipped step (the third raises before its row is written)
    assert [float(r["train/nonfinite_skipped"]) for r in rows] == [1.0, 2.0]
    assert [int(r["step"]) for r in rows] == [1, 2]  # step 0 was still finite and trained
    assert all(r["train/main/loss"] == "nan" for r in rows)  # no stale loss on skipped steps


def test_nonfinite_stretch_stops_with_a_checkpoint_of_the_last_good_state(tmp_path, data):
    """Sporadic NaN batches (2 in a row, under the limit) are skipped and training goes on; a
    later stretch stops the run after 3 in a row, and the last.ckpt it writes holds exactly the
    weights of the last finite step. Resuming from it (the fault gone) trains to the end."""
    train, val = data
    bad = [3, 4] + list(range(8, 20))
    log = tmp_path / "steps.jsonl"
    ov = base_overrides(tmp_path, train, val) + [
        "trainer.max_steps=16", "max_nonfinite_in_row=3", "trainer.limit_val_batches=0",
        "+callbacks.nan._target_=train_utils.NonFiniteInjector",
        f"+callbacks.nan.steps={bad}", f"+callbacks.nan.out={log}"]
    with pytest.raises(FloatingPointError, match=r"3 non-finite steps in a row .*5 in all; "
                                                 r"stopped at step 11\. .*last\.ckpt holds the last good"):
        run_train(ov, tmp_path / "run")
    steps = [json.loads(x) for x in log.read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(11))  # stopped after the batch of step 10
    good = [s for s in steps if not s["poisoned"]]
    assert [s["step"] for s in good] == [0, 1, 2, 5, 6, 7]  # trained between the NaN batches
    assert steps[4]["digest"] == steps[2]["digest"] != steps[5]["digest"]  # skips change nothing

    ck = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu",
                    weights_only=True)
    assert ck["global_step"] == 11
    assert ck["dflash"]["nonfinite_total"] == 5 and ck["dflash"]["nonfinite_in_row"] == 3
    weights = {k.removeprefix("drafters."): v for k, v in ck["state_dict"].items()
               if k.startswith("drafters.")}
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert state_digest(weights) == good[-1]["digest"]  # the state after step 7, the last good one

    ov_resume = [o for o in ov if "callbacks.nan" not in o] + [
        f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}"]
    run_train(ov_resume, tmp_path / "resumed")
    ck = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", map_location="cpu",
                    weights_only=True)
    assert ck["global_step"] == 16 and ck["dflash"]["nonfinite_total"] == 5
    assert ck["dflash"]["nonfinite_in_row"] == 0


def test_train_window_metrics_after_a_resume_equal_the_straight_run(tmp_path, data):
    """A checkpoint taken at a log-interval boundary (every 3 steps, logged every 3) must not
    carry the window it just logged: after a resume every train_window value and the final
    metric states equal the uninterrupted run's."""
    train, val = data
    ov = base_overrides(tmp_path, train, val) + [
        "experiment=v5_hardce", "trainer.max_steps=9", "trainer.log_every_n_steps=3",
        "callbacks.model_checkpoint.every_n_train_steps=3"]
    run_train(ov, tmp_path / "straight")
    mid = tmp_path / "straight" / "checkpoints" / "step0000003.ckpt"
    run_train(ov + [f"ckpt_path={mid}"], tmp_path / "resumed")
    keys = [k for k in _metrics(tmp_path / "straight")[0] if k.startswith("train_window/main/")]
    win = {n: {(r["step"], k): r[k] for r in _metrics(tmp_path / n) for k in keys if r.get(k)}
           for n in ("straight", "resumed")}
    resumed = {sk: v for sk, v in win["resumed"].items() if int(sk[0]) > 3}
    assert resumed and all(win["straight"][sk] == v for sk, v in resumed.items())
    sa = torch.load(tmp_path / "straight" / "checkpoints" / "last.ckpt", weights_only=True)
    sb = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)
    for k, v in sa["state_dict"].items():
        if k.startswith("train_metrics."):
            assert torch.equal(v, sb["state_dict"][k]), k


def test_train_vocab_reduces_the_training_softmax_only(tmp_path, data):
    """train_vocab=<whole vocab> trains bit-identically to the full softmax; a small one gives
    a lower first-step CE (fewer classes, same init); a loss that needs the full distribution
    refuses it."""
    train, val = data
    ov = base_overrides(tmp_path, train, val) + ["trainer.max_steps=2"]
    vocab = int(compose_train(ov, tmp_path / "c").target.build.vocab_size)
    runs = {}
    for name, k in (("full", "null"), ("all", str(vocab)), ("small", "32")):
        run_train(ov + [f"train_vocab={k}"], tmp_path / name)
        runs[name] = _metrics(tmp_path / name)
    losses = {n: [float(r["train/main/loss"]) for r in m if r.get("train/main/loss")]
              for n, m in runs.items()}
    assert losses["all"] == losses["full"]
    assert losses["small"][0] < losses["full"][0]
    # the checkpoint records the ids (evaluate.py draft_vocab=true drafts over them)
    small = torch.load(tmp_path / "small" / "checkpoints" / "last.ckpt", weights_only=True)
    ids = small["dflash"]["train_vocab"]
    assert len(ids) == 32 and ids == sorted(set(ids)) and max(ids) < vocab
    full = torch.load(tmp_path / "full" / "checkpoints" / "last.ckpt", weights_only=True)
    assert full["dflash"]["train_vocab"] is None
    with pytest.raises(UserError, match="train_vocab"):
        run_train(ov + ["train_vocab=32", "loss=composite"], tmp_path / "bad")


def test_a_run_stopped_mid_epoch_leaves_one_last_ckpt_and_resumes_from_it(tmp_path, data):
    """max_steps inside an epoch: one last.ckpt (no last-v1.ckpt from the epoch-end save), at
    the step boundary with the epoch unfinished, and ``ckpt_path=last`` continues that epoch."""
    train, val = data
    ov = base_overrides(tmp_path, train, val) + ["callbacks.model_checkpoint.every_n_train_steps=100"]
    run = tmp_path / "run"
    run_train(ov + ["trainer.max_steps=3"], run)
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["last.ckpt"]
    ck = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)
    sampler = ck["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["_index_sampler_state"]
    assert ck["global_step"] == 3 and sampler["epoch"] == 0 and sampler["batches_consumed"] == 3
    assert sampler["num_batches"] > 5  # the stop was inside the epoch
    run_train(ov + ["trainer.max_steps=5", "ckpt_path=last"], run)
    ck = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)
    sampler = ck["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["_index_sampler_state"]
    assert ck["global_step"] == 5 and (sampler["epoch"], sampler["batches_consumed"]) == (0, 5)
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["last.ckpt"]


def test_module_settings_defaults_are_the_configs(tmp_path):
    """One settings object builds the module; its defaults are conf/'s, so a module built in
    a notebook behaves like one built by train.py."""
    from dataclasses import fields

    from dflash_lit.train.module import ModuleSettings
    from dflash_lit.train.run import module_settings

    cfg = compose_train(["budget=full", "trainer.precision=32-true"], tmp_path)  # no scaling
    got = module_settings(cfg, total_steps=10)
    default = ModuleSettings(total_steps=10)
    for f in fields(ModuleSettings):
        if f.name != "compile_mask" or not torch.cuda.is_available():  # auto: on CUDA
            assert getattr(got, f.name) == getattr(default, f.name), f.name


def test_drafter_initialised_from_a_target_layer(tmp_path):
    """drafter.init_from_target_layer=5 copies that decoder layer's projections and norms
    (and the final norm) into the drafter; a drafter of another shape is a one-line error."""
    from dflash_lit.errors import UserError
    from dflash_lit.train.build import target_layer_state
    from dflash_lit.train.run import build_run

    data = make_shards(tmp_path / "train", n=8)
    shape = ["drafter.intermediate_size=128", "drafter.init_from_target_layer=5"]
    cfg = compose_train(base_overrides(tmp_path, data) + shape, tmp_path / "r")
    module, _, _ = build_run(cfg)
    drafter = module.drafters["main"]
    ref = target_layer_state(cfg.target, 5)
    for name, t in drafter.layers[0].state_dict().items():
        assert torch.equal(t, ref[name]), name
    assert torch.equal(drafter.norm.weight, ref["final_norm.weight"])
    other = compose_train(base_overrides(tmp_path, data) + ["drafter.init_from_target_layer=5"],
                          tmp_path / "r2")  # intermediate 96 against the target's 128
    with pytest.raises(UserError, match=r"init_from_target_layer=5: .*mlp.gate_proj.weight: "
                                        r"drafter \(96, 64\), target \(128, 64\)") as e:
        build_run(other)
    assert "\n" not in str(e.value)
    far = compose_train(base_overrides(tmp_path, data) + ["drafter.init_from_target_layer=8"],
                        tmp_path / "r3")
    with pytest.raises(UserError, match=r"init_from_target_layer=8 is not a layer"):
        build_run(far)
