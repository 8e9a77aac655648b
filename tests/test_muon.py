"""optim=muon: torch's Muon on the drafters' 2-D matrices + AdamW on the rest, as ONE optimizer
(train/optim.py): its groups, its update, its state round trip and a bit-exact resume."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from train_utils import base_overrides, drafter_state, make_shards, run_train

from dflash_lit import DFlashConfig, DFlashDrafter
from dflash_lit.errors import UserError
from dflash_lit.train.optim import MuonAdamW, build_optimizer
from dflash_lit.train.spec import DrafterSpec, MuonSettings

MUON = MuonSettings(lr_scale=2.0, weight_decay=0.1)
BETAS, EPS = (0.9, 0.95), 1e-8


def tiny_drafter(seed: int, bias: bool = False) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(DFlashConfig(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        intermediate_size=24, num_hidden_layers=1, block_size=4, num_target_layers=4,
        target_layer_ids=[0, 2], attention_bias=bias))


def setup(bias: bool = False):
    drafters = torch.nn.ModuleDict({"a": tiny_drafter(0, bias), "b": tiny_drafter(1)})
    specs = {"a": DrafterSpec("a", drafters["a"].config, lr=1e-2, weight_decay=0.01),
             "b": DrafterSpec("b", drafters["b"].config, lr=3e-3)}
    return drafters, specs


def fake_grads(drafters: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in drafters.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_muon_groups_hold_exactly_the_2d_matrices():
    drafters, specs = setup(bias=True)
    opt = build_optimizer(drafters, specs, BETAS, EPS, MUON)
    assert isinstance(opt, MuonAdamW)
    for name, d in drafters.items():
        (mg,) = [g for g in opt.param_groups if g["name"] == f"{name}/muon" and g["kind"] == "muon"]
        (ag,) = [g for g in opt.param_groups if g["name"] == name and g["kind"] == "adamw"]
        names = {id(p): n for n, p in d.named_parameters()}
        muon = sorted(names[id(p)] for p in mg["params"])
        assert muon == sorted(n for n, p in d.named_parameters() if p.ndim == 2)
        assert "fc.weight" in muon and "layers.0.self_attn.q_proj.weight" in muon
        assert "layers.0.mlp.down_proj.weight" in muon
        adamw = sorted(names[id(p)] for p in ag["params"])
        assert adamw == sorted(n for n, p in d.named_parameters() if p.ndim != 2)
        assert all("norm" in n or n.endswith(".bias") for n in adamw)
        assert (name != "a") or "layers.0.self_attn.q_proj.bias" in adamw  # biases: AdamW
        assert mg["lr"] == specs[name].lr * MUON.lr_scale and mg["weight_decay"] == 0.1
        assert ag["lr"] == specs[name].lr and ag["weight_decay"] == specs[name].weight_decay
        assert (mg["momentum"], mg["ns_steps"], mg["adjust_lr_fn"]) == (0.95, 5, "match_rms_adamw")
    assert opt.muon.param_groups == opt.param_groups[:2]  # the inner optimizers' own groups
    assert opt.adamw.param_groups == opt.param_groups[2:]
    plain = build_optimizer(drafters, specs, BETAS, EPS)  # optim=adamw: one group per drafter
    assert type(plain) is torch.optim.AdamW and [g["name"] for g in plain.param_groups] == ["a", "b"]


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalisation, in float64 (Keller Jordan's constants)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def test_update_equals_torch_muon_and_adamw_and_the_newton_schulz_formula():
    """Two steps under an LR schedule: every matrix moves exactly as a standalone
    torch.optim.Muon moves it, every norm weight as a standalone AdamW; and the matrices' update
    is the Newton-Schulz formula (to bf16 precision: torch runs the iteration in bf16)."""
    drafters, specs = setup()
    ref = copy.deepcopy(drafters)
    opt = build_optimizer(drafters, specs, BETAS, EPS, MUON)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: [0.5, 1.0][min(s, 1)])
    ref_mats = {n: [p for p in ref[n].parameters() if p.ndim == 2] for n in ref}
    ref_rest = {n: [p for p in ref[n].parameters() if p.ndim != 2] for n in ref}
    muon = torch.optim.Muon([{"params": ref_mats[n], "lr": specs[n].lr * 2.0} for n in ref],
                            weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": ref_rest[n], "lr": specs[n].lr,
                                "weight_decay": specs[n].weight_decay} for n in ref],
                              betas=BETAS, eps=EPS)
    fc_before = drafters["a"].fc.weight.detach().clone()
    for step in range(2):
        fake_grads(drafters, step)
        fake_grads(ref, step)
        if step == 0:
            g0 = drafters["a"].fc.weight.grad.clone()
        factor = [0.5, 1.0][step]
        for o in (muon, adamw):
            for g, n in zip(o.param_groups, ref, strict=True):
                g["lr"] = (specs[n].lr * (2.0 if o is muon else 1.0)) * factor
        opt.step()
        muon.step()
        adamw.step()
        sched.step()
        if step == 0:
            fc_after = drafters["a"].fc.weight.detach().clone()
    for a, b in zip(drafters.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    # step 0 by hand: buffer = (1-μ)·g, Nesterov update g + μ·(buffer - g), lr 0.5 x 1e-2 x 2
    lr = 0.5 * specs["a"].lr * 2.0
    mu = 0.95
    upd = g0 + mu * ((1 - mu) * g0 - g0)
    got = fc_before.double() * (1 - lr * 0.1) - fc_after.double()  # decay first, then the update
    want = lr * 0.2 * math.sqrt(max(fc_before.shape)) * newton_schulz(upd)  # match_rms_adamw
    assert float((got - want).norm() / want.norm()) < 0.02  # bf16 iteration vs float64


def test_state_dict_round_trip_is_exact():
    """Save after 3 steps, load into a fresh optimizer over copied weights, 2 more steps: the
    same weights and state as 5 steps straight; a plain AdamW state is refused."""
    drafters, specs = setup()
    opt = build_optimizer(drafters, specs, BETAS, EPS, MUON)
    for step in range(3):
        fake_grads(drafters, step)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    copy_d = copy.deepcopy(drafters)
    resumed = build_optimizer(copy_d, specs, BETAS, EPS, MUON)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed.muon.state is resumed.state and resumed.muon.param_groups[0] is resumed.param_groups[0]
    for step in range(3, 5):
        fake_grads(drafters, step)
        fake_grads(copy_d, step)
        opt.step()
        resumed.step()
    for a, b in zip(drafters.parameters(), copy_d.parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict(), resumed.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, st in sa["state"].items():
        assert st.keys() == sb["state"][i].keys()
        assert all(torch.equal(v, sb["state"][i][k]) for k, v in st.items())
    kinds = {i: set(st) for i, st in sa["state"].items()}
    assert {"momentum_buffer"} in kinds.values() and {"step", "exp_avg", "exp_avg_sq"} in kinds.values()
    with pytest.raises(UserError, match="not a Muon \\+ AdamW state"):
        resumed.load_state_dict(build_optimizer(copy_d, specs, BETAS, EPS).state_dict())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return make_shards(root / "train", n=24), make_shards(root / "val", n=4, seed=1)


def test_resume_is_bit_exact_with_muon_and_several_drafters(tmp_path, data):
    """v6_muon with two drafters: 6 steps straight == 3, stop, resume, 3 (weights, Muon
    momentum buffers, Adam moments); resuming it with optim=adamw fails before training."""
    ov = base_overrides(tmp_path, *data) + [
        "experiment=v6_muon",
        "+drafters.fast.optim.lr=2e-3",  # a second drafter with its own lr (both groups)
        "trainer.max_steps=6",
        "callbacks.model_checkpoint.every_n_train_steps=3",
        "trainer.limit_val_batches=0",
        "optim.warmup_frac=0.3",
        "+callbacks.lr_monitor._target_=lightning.pytorch.callbacks.LearningRateMonitor",
    ]
    _, cfg = run_train(ov, tmp_path / "straight")
    assert cfg.optim.name == "muon" and cfg.run_name == "v6_muon"
    assert cfg.drafter.drop_last_context_layers == 1  # the v5 recipe underneath
    header = (tmp_path / "straight" / "csv" / "metrics.csv").read_text().splitlines()[0]
    assert "lr-MuonAdamW/main/muon" in header and "train/fast/muon_lr" in header
    ckpts = tmp_path / "straight" / "checkpoints"
    run_train(ov + [f"ckpt_path={ckpts / 'step0000003.ckpt'}"], tmp_path / "resumed")
    last_a, last_b = ckpts / "last.ckpt", tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    a, b = drafter_state(last_a), drafter_state(last_b)
    assert sorted({k.split(".")[1] for k in a}) == ["fast", "main"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    ca, cb = (torch.load(p, weights_only=True) for p in (last_a, last_b))
    assert ca["dflash"]["optimizer"] == "muon"
    oa, ob = ca["optimizer_states"][0], cb["optimizer_states"][0]
    assert [(g["name"], g["kind"]) for g in oa["param_groups"]] == [
        ("main/muon", "muon"), ("fast/muon", "muon"), ("main", "adamw"), ("fast", "adamw")]
    assert [g["initial_lr"] for g in oa["param_groups"]] == [1e-3, 2e-3, 1e-3, 2e-3]
    assert oa["state"].keys() == ob["state"].keys() and len(oa["state"]) == len(a)
    for i, st in oa["state"].items():
        assert all(torch.equal(v, ob["state"][i][k]) for k, v in st.items())
    with pytest.raises(UserError, match="trained with optim=muon, the config has optim=adamw"):
        run_train([o for o in ov if o != "experiment=v6_muon"]
                  + ["experiment=v5_hardce", f"ckpt_path={last_a}"], tmp_path / "wrong")
