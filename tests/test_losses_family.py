"""D-PACE and the distillation family (forward/reverse KL, JSD, TV, CE + divergence):
hand-computed values, explicit per-slot loop references, gradients, batch splitting, the
fused D-PACE path, configs, and a short multi-drafter training run through train.py."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from train_utils import CONF, base_overrides, make_shards, run_train

from dflash_lit.errors import UserError
from dflash_lit.train.feature_cache import cache_needs_distribution, resolve_topk
from dflash_lit.train.linear_ce import fused_dpace
from dflash_lit.train.losses import (
    IGNORE,
    LOSSES,
    DistillLoss,
    DPaceLoss,
    build_loss,
    composite_loss,
    distill_loss,
    dpace_loss,
    dpace_weights,
    target_argmax_labels,
)

I = IGNORE  # noqa: E741
DIVS = ("forward_kl", "reverse_kl", "jsd", "tv")


# --------------------------------------------------------------------------- references
def _softmax(row: list[float], t: float = 1.0) -> list[float]:
    z = [x / t for x in row]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    return [x / sum(e) for x in e]


def _ref_div(p: list[float], q: list[float], div: str) -> float:
    """The divergence of two probability lists, written out from its definition."""
    def kl(a, b):
        return sum(ai * math.log(ai / bi) for ai, bi in zip(a, b) if ai > 0)

    if div == "forward_kl":
        return kl(p, q)
    if div == "reverse_kl":
        return kl(q, p)
    if div == "jsd":
        m = [(pi + qi) / 2 for pi, qi in zip(p, q)]
        return 0.5 * kl(p, m) + 0.5 * kl(q, m)
    return 0.5 * sum(abs(pi - qi) for pi, qi in zip(p, q))


def _ref_dpace_block(q: dict[int, float], bs: int, alpha: float) -> list[float]:
    """D-PACE weights of one block from the label probabilities q[k] of its valid slots:
    w_k = Σ_{m>=k valid} Π_{i<=m valid} ((1-α)·q_i + α), literally."""
    w = [0.0] * bs
    for k in q:
        for m in q:
            if m < k:
                continue
            prod = 1.0
            for i in q:
                if i <= m:
                    prod *= (1 - alpha) * q[i] + alpha
            w[k] += prod
    return w


def _ref_dpace(logits, labels, alpha, gamma, normalize) -> float:
    b, n, bs, _ = logits.shape
    num = den = 0.0
    for i in range(b):
        for j in range(n):
            q = {k: _softmax(logits[i, j, k].double().tolist())[int(labels[i, j, k])]
                 for k in range(1, bs) if int(labels[i, j, k]) != I}
            w = _ref_dpace_block(q, bs, alpha)
            for k, qk in q.items():
                wk = w[k] * (1.0 if gamma is None else math.exp(-(k - 1) / gamma))
                num += wk * -math.log(qk)
                den += wk if normalize == "weights" else 1.0
    return num / den


def _ref_dpace_torch(logits, labels, alpha, gamma, normalize) -> torch.Tensor:
    """Per-slot torch loop with the weights as python floats (no gradient through them)."""
    b, n, bs, _ = logits.shape
    num = torch.zeros((), dtype=torch.float64)
    den = 0.0
    for i in range(b):
        for j in range(n):
            ce = {k: -torch.log_softmax(logits[i, j, k].double(), -1)[int(labels[i, j, k])]
                  for k in range(1, bs) if int(labels[i, j, k]) != I}
            w = _ref_dpace_block({k: math.exp(-c.item()) for k, c in ce.items()}, bs, alpha)
            for k, c in ce.items():
                wk = w[k] * (1.0 if gamma is None else math.exp(-(k - 1) / gamma))
                num = num + wk * c
                den += wk if normalize == "weights" else 1.0
    return num / den


def _ref_distill_torch(logits, labels, target, div, gamma, div_w, ce_w, t, streak) -> torch.Tensor:
    """Per-slot torch loop of distill_loss; divergences from their definitions; the
    position/streak weights are python floats."""
    b, n, bs, _ = logits.shape
    num = torch.zeros((), dtype=torch.float64)
    den = 0.0
    for i in range(b):
        for j in range(n):
            s = 1.0
            for k in range(1, bs):
                y = int(labels[i, j, k])
                if y == I:
                    continue
                d = logits[i, j, k].double()
                q = torch.softmax(d / t, -1)
                p = torch.softmax(target[i, j, k].double() / t, -1)
                if div == "forward_kl":
                    dv = (p * (p.log() - q.log())).sum()
                elif div == "reverse_kl":
                    dv = (q * (q.log() - p.log())).sum()
                elif div == "jsd":
                    m = (p + q) / 2
                    dv = 0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum()
                else:
                    dv = 0.5 * (p - q).abs().sum()
                ce = -torch.log_softmax(d, -1)[y]
                w = (1.0 if gamma is None else math.exp(-(k - 1) / gamma)) * (s if streak else 1)
                num = num + w * (div_w * t * t * dv + ce_w * ce)
                den += w
                s *= math.exp(-ce.item())
    return num / den


def _random_batch(seed: int, b=2, n=3, bs=5, v=7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, n, bs, v, generator=g) * 2
    target = torch.randn(b, n, bs, v, generator=g) * 2
    labels = torch.randint(0, v, (b, n, bs), generator=g)
    labels[..., 0] = I
    labels[0, n - 1] = I  # a padding block
    labels[1, 0, 3:] = I  # block running past the sequence end
    labels[b - 1, 1, 2] = I  # a prompt token inside a block
    return logits, labels, target


def _dpace_hand():
    """One block, Bs=5, V=2, label 0: slot k's logits [ln q, ln(1-q)] give p(label) = q
    exactly; q1 = 0.8, q2 = 0.5, slot 3 ignored, q4 = 0.2; slot 0 carries garbage."""
    def row(q):
        return [math.log(q), math.log(1 - q)]

    logits = torch.tensor([[[[9.0, -9.0], row(0.8), row(0.5), [5.0, -5.0], row(0.2)]]])
    labels = torch.tensor([[[1, 0, 0, I, 0]]])
    return logits, labels


# --------------------------------------------------------------------------- D-PACE
def test_dpace_weights_hand_computed():
    logits, labels = _dpace_hand()
    valid = labels != I
    valid[..., 0] = False
    ce = -torch.log_softmax(logits, -1)[..., 0]
    # α = 0.5: q̃ = 0.9, 0.75, (1), 0.6 -> C1 = 0.9, C2 = 0.675, C4 = 0.405
    # w1 = 0.9 + 0.675 + 0.405, w2 = 0.675 + 0.405, w4 = 0.405
    w = dpace_weights(ce, valid, 0.5)[0, 0]
    assert w.tolist() == pytest.approx([0.0, 1.98, 1.08, 0.0, 0.405], abs=1e-6)
    # α = 1: every q̃ = 1, so w_k counts the valid slots from k on
    assert dpace_weights(ce, valid, 1.0)[0, 0].tolist() == pytest.approx([0, 3, 2, 0, 1])
    # α = 0 (unsmoothed): C1 = 0.8, C2 = 0.4, C4 = 0.08
    assert dpace_weights(ce, valid, 0.0)[0, 0].tolist() == pytest.approx(
        [0.0, 1.28, 0.48, 0.0, 0.08], abs=1e-6)


def test_dpace_loss_hand_computed():
    logits, labels = _dpace_hand()
    ce = [math.log(1 / 0.8), math.log(2.0), math.log(5.0)]
    w = [1.98, 1.08, 0.405]
    num = sum(a * b for a, b in zip(w, ce))
    out = dpace_loss(logits, labels, alpha=0.5)
    assert out.loss.item() == pytest.approx(num / 3.465, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.5316726, abs=1e-6)
    assert out.weight_sum.item() == pytest.approx(3.465, abs=1e-6)
    assert int(out.n_valid) == 3
    assert out.per_slot_ce[0, 0].tolist() == pytest.approx([0, ce[0], ce[1], 0, ce[2]], abs=1e-6)
    slots = dpace_loss(logits, labels, alpha=0.5, normalize="slots")
    assert slots.loss.item() == pytest.approx(num / 3, abs=1e-6)
    assert slots.weight_sum.item() == 3.0
    # γ = 1 multiplies w_k by exp(-(k-1)): slot 2 by e^-1, slot 4 by e^-3
    wg = [1.98, 1.08 * math.exp(-1), 0.405 * math.exp(-3)]
    decayed = dpace_loss(logits, labels, alpha=0.5, gamma=1.0)
    assert decayed.loss.item() == pytest.approx(
        sum(a * b for a, b in zip(wg, ce)) / sum(wg), abs=1e-6)


@pytest.mark.parametrize("normalize", ["weights", "slots"])
@pytest.mark.parametrize("alpha,gamma", [(0.5, None), (0.3, 4.0), (1.0, None), (0.0, 7.0)])
def test_dpace_matches_loop_reference(alpha, gamma, normalize):
    logits, labels, _ = _random_batch(0)
    out = dpace_loss(logits, labels, alpha, gamma, normalize)
    assert out.loss.item() == pytest.approx(
        _ref_dpace(logits, labels, alpha, gamma, normalize), abs=1e-6)


@pytest.mark.parametrize("normalize", ["weights", "slots"])
def test_dpace_gradient_treats_weights_as_constants(normalize):
    logits, labels, _ = _random_batch(1, b=2, n=2, bs=5, v=6)
    poisoned = logits.clone()
    poisoned[labels == I] = float("nan")  # ignored slots (slot 0 included) never leak in
    lg = poisoned.clone().requires_grad_(True)
    out = dpace_loss(lg, labels, 0.5, 4.0, normalize)
    out.loss.backward()
    assert lg.grad[labels == I].abs().max().item() == 0.0
    lg_ref = logits.clone().requires_grad_(True)
    ref = _ref_dpace_torch(lg_ref, labels, 0.5, 4.0, normalize)
    ref.backward()
    assert out.loss.item() == pytest.approx(ref.item(), abs=1e-6)
    valid = labels != I
    assert torch.allclose(lg.grad[valid], lg_ref.grad[valid].float(), atol=1e-6)


def test_dpace_all_invalid_is_zero_and_differentiable():
    logits = torch.randn(1, 2, 4, 5, requires_grad=True)
    out = dpace_loss(logits, torch.full((1, 2, 4), I))
    assert out.loss.item() == 0.0 and int(out.n_valid) == 0
    out.loss.backward()
    assert logits.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("normalize", ["weights", "slots"])
@pytest.mark.parametrize("gamma", [None, 4.0])
def test_fused_dpace_equals_materialised(normalize, gamma):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 3, 5, 8, generator=g)
    weight = torch.randn(11, 8, generator=g)
    _, labels, _ = _random_batch(3, b=2, n=3, bs=5, v=11)
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    ref = dpace_loss(h1 @ weight.T, labels, 0.5, gamma, normalize)
    ref.loss.backward()
    out, pred = fused_dpace(h2, weight, labels, 0.5, gamma, normalize, chunk_rows=4,
                            compute_dtype=torch.float32)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(ref.loss.item(), abs=1e-5)
    assert out.weight_sum.item() == pytest.approx(ref.weight_sum.item(), abs=1e-5)
    assert int(out.n_valid) == int(ref.n_valid)
    assert torch.allclose(out.per_slot_ce, ref.per_slot_ce, atol=1e-5)
    assert torch.allclose(h2.grad, h1.grad, atol=1e-5)
    valid = ref.per_slot_ce != 0
    assert torch.equal(pred[valid], (h1 @ weight.T).argmax(-1)[valid])


# --------------------------------------------------------------------------- batch splitting
def _split_cases():
    return [
        ("dpace", lambda lg, lb, tg: dpace_loss(lg, lb, 0.5, None, "weights")),
        ("dpace_slots", lambda lg, lb, tg: dpace_loss(lg, lb, 0.3, 4.0, "slots")),
        ("jsd_streak", lambda lg, lb, tg: distill_loss(lg, lb, tg, "jsd", 7.0, 1.0, 0.2, 2.0,
                                                       True)),
    ]


@pytest.mark.parametrize("case", _split_cases(), ids=lambda c: c[0])
def test_two_halves_combine_to_the_whole_batch(case):
    """Rows split in two (as across DDP ranks or micro-batches): the halves' ratios combined
    as (L_a·W_a + L_b·W_b) / (W_a + W_b) give the whole batch's loss and gradient."""
    _, fn = case
    logits, labels, target = _random_batch(4, b=4, n=2, bs=5, v=6)
    whole_leaf = logits.clone().requires_grad_(True)
    whole = fn(whole_leaf, labels, target)
    whole.loss.backward()
    leaf = logits.clone().requires_grad_(True)
    a = fn(leaf[:1], labels[:1], target[:1])  # uneven split: 1 row | 3 rows
    b = fn(leaf[1:], labels[1:], target[1:])
    combined = (a.loss * a.weight_sum + b.loss * b.weight_sum) / (a.weight_sum + b.weight_sum)
    combined.backward()
    assert combined.item() == pytest.approx(whole.loss.item(), abs=1e-6)
    assert torch.allclose(leaf.grad, whole_leaf.grad, atol=1e-7)


# --------------------------------------------------------------------------- divergences
def test_divergences_hand_computed():
    # target p = [1/4, 3/4] (logits [0, ln 3]), draft q = [1/2, 1/2] (logits [0, 0])
    logits = torch.zeros(1, 1, 2, 2)
    target = torch.tensor([[[[0.0, 0.0], [0.0, math.log(3.0)]]]])
    labels = torch.tensor([[[I, 1]]])
    expected = {
        "forward_kl": 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5),  # 0.130812
        "reverse_kl": 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75),  # 0.143841
        # m = [3/8, 5/8]
        "jsd": 0.5 * (0.25 * math.log(0.25 / 0.375) + 0.75 * math.log(0.75 / 0.625))
        + 0.5 * (0.5 * math.log(0.5 / 0.375) + 0.5 * math.log(0.5 / 0.625)),  # 0.033822
        "tv": 0.5 * (abs(0.25 - 0.5) + abs(0.75 - 0.5)),  # 0.25
    }
    literal = {"forward_kl": 0.130812, "reverse_kl": 0.143841, "jsd": 0.033822, "tv": 0.25}
    for div, value in expected.items():
        out = distill_loss(logits, labels, target, div, gamma=None)
        assert out.loss.item() == pytest.approx(value, abs=1e-6), div
        assert out.loss.item() == pytest.approx(literal[div], abs=1e-6), div
        assert out.per_slot_kl[0, 0, 1].item() == pytest.approx(value, abs=1e-6)
    # the CE + KL mix: 0.5·KL + 0.5·CE, CE = -ln q(1) = ln 2
    mix = distill_loss(logits, labels, target, "forward_kl", None, div_weight=0.5, ce_weight=0.5)
    assert mix.loss.item() == pytest.approx(0.5 * expected["forward_kl"] + 0.5 * math.log(2))


@pytest.mark.parametrize("div", DIVS)
def test_divergence_matches_definition_on_random_rows(div):
    logits, labels, target = _random_batch(5, v=6)
    for t in (1.0, 2.0):
        out = distill_loss(logits, labels, target, div, gamma=None, temperature=t)
        num = den = 0.0
        for i, j, k in zip(*torch.nonzero(labels != I, as_tuple=True)):
            if k == 0:
                continue
            p = _softmax(target[i, j, k].double().tolist(), t)
            q = _softmax(logits[i, j, k].double().tolist(), t)
            num += _ref_div(p, q, div) * t * t
            den += 1.0
        assert out.loss.item() == pytest.approx(num / den, abs=1e-6)


@pytest.mark.parametrize("div", DIVS)
@pytest.mark.parametrize("streak", [False, True])
def test_distill_value_and_gradient_match_loop_reference(div, streak):
    logits, labels, target = _random_batch(6, b=2, n=2, bs=5, v=6)
    args = (div, 4.0, 0.7, 0.3, 2.0, streak)
    lg = logits.clone().requires_grad_(True)
    out = distill_loss(lg, labels, target, *args)
    out.loss.backward()
    lg_ref = logits.clone().requires_grad_(True)
    ref = _ref_distill_torch(lg_ref, labels, target, *args)
    ref.backward()
    assert out.loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(lg.grad, lg_ref.grad.float(), atol=1e-6)
    assert lg.grad[labels == I].abs().max().item() == 0.0


def test_composite_is_distill_forward_kl():
    logits, labels, target = _random_batch(7)
    a = composite_loss(logits, labels, target, gamma=10.0)
    b = distill_loss(logits, labels, target, "forward_kl", 10.0, 0.7, 0.3, 2.0, True)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.per_slot_kl, b.per_slot_kl)


def test_distill_handles_minus_inf_target_logits():
    """A target that masks part of its vocab with -inf: p = 0 there, 0·log 0 = 0."""
    logits = torch.zeros(1, 1, 2, 3)
    target = torch.tensor([[[[0.0, 0.0, 0.0], [0.0, 0.0, -math.inf]]]])
    labels = torch.tensor([[[I, 0]]])
    fwd = distill_loss(logits, labels, target, "forward_kl", None)
    assert fwd.loss.item() == pytest.approx(math.log(1.5), abs=1e-6)  # KL([½,½,0]‖[⅓,⅓,⅓])
    assert torch.isfinite(distill_loss(logits, labels, target, "jsd", None).loss)
    assert torch.isinf(distill_loss(logits, labels, target, "reverse_kl", None).loss)


def test_distill_needs_target():
    logits, labels, _ = _random_batch(8)
    with pytest.raises(ValueError, match="loss.divergence=jsd needs the target"):
        distill_loss(logits, labels, None, "jsd")


# --------------------------------------------------------------------------- configured losses
def test_configured_losses_and_what_they_need():
    logits, labels, target = _random_batch(9)
    dp = build_loss("dpace", alpha=0.5, gamma=None, normalize="weights", labels="target_argmax")
    assert isinstance(dp, DPaceLoss) and dp.needs_target_logits
    assert not dp.needs_target_distribution and not dp.needs_full_distribution
    tl = target_argmax_labels(target, labels)
    assert dp(logits, labels, target).loss.item() == pytest.approx(
        _ref_dpace(logits, tl, 0.5, None, "weights"), abs=1e-6)
    assert not build_loss("dpace", labels="data").needs_target_logits
    for div in DIVS:
        fn = build_loss("distill", divergence=div)
        assert isinstance(fn, DistillLoss) and fn.needs_target_logits
        assert fn.needs_target_distribution
        assert fn.needs_full_distribution == (div == "reverse_kl")
        ref = distill_loss(logits, tl, target, div, 7.0)
        assert fn(logits, labels, target).loss.item() == pytest.approx(ref.loss.item(), abs=1e-7)


@pytest.mark.parametrize("name,kwargs,key", [
    ("dpace", {"alpha": -0.1}, "loss.alpha"),
    ("dpace", {"alpha": 1.5}, "loss.alpha"),
    ("dpace", {"normalize": "mean"}, "loss.normalize"),
    ("dpace", {"gamma": 0}, "loss.gamma"),
    ("dpace", {"labels": "argmax"}, "loss.labels"),
    ("dpace", {"temperature": 2.0}, "unknown key"),
    ("distill", {"divergence": "kl"}, "loss.divergence"),
    ("distill", {"div_weight": -1.0}, "loss.div_weight"),
    ("distill", {"ce_weight": -0.5}, "loss.ce_weight"),
    ("distill", {"div_weight": 0.0, "ce_weight": 0.0}, "loss.div_weight"),
    ("distill", {"temperature": 0.0}, "loss.temperature"),
    ("distill", {"gamma": -7.0}, "loss.gamma"),
    ("composite", {"kl_weight": -0.7}, "loss.kl_weight"),
])
def test_bad_config_values_are_user_errors(name, kwargs, key):
    with pytest.raises(UserError, match=key) as e:
        build_loss(name, **kwargs)
    assert "\n" not in str(e.value)


def _loss_yamls() -> list[Path]:
    return sorted((CONF / "loss").glob("*.yaml"))


@pytest.mark.parametrize("path", _loss_yamls(), ids=lambda p: p.stem)
def test_every_loss_yaml_builds_and_comments_each_key(path):
    cfg = yaml.safe_load(path.read_text())
    loss = build_loss(**cfg)  # every key is one the loss takes
    assert set(cfg) - {"name"} == set(type(loss).__dataclass_fields__)  # ... and all are set
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            assert "#" in line.split(":", 1)[1], f"{path.name}: no comment on {line!r}"


def test_new_options_exist():
    names = {p.stem for p in _loss_yamls()}
    assert {"dpace", "forward_kl", "reverse_kl", "jsd", "tv", "ce_kl"} <= names
    assert {"dpace", "distill"} <= set(LOSSES)


def test_cache_requests_topk_for_distillation_and_refuses_reverse_kl():
    null_topk = OmegaConf.create({"topk": None})
    only_ce = {"a": build_loss("dpace"), "b": build_loss("hard_ce")}
    assert resolve_topk(null_topk, cache_needs_distribution(only_ce)) == 0
    for conf in ("forward_kl", "jsd", "tv", "ce_kl"):
        cfg = yaml.safe_load((CONF / "loss" / f"{conf}.yaml").read_text())
        with_kl = {**only_ce, "c": build_loss(**cfg)}
        assert resolve_topk(null_topk, cache_needs_distribution(with_kl)) == 64
    rev = yaml.safe_load((CONF / "loss" / "reverse_kl.yaml").read_text())
    with pytest.raises(UserError, match=r"drafters\.r\.loss\.divergence=reverse_kl.*features"):
        cache_needs_distribution({"a": build_loss("dpace"), "r": build_loss(**rev)})


# --------------------------------------------------------------------------- train.py
def test_dpace_trains_three_drafters_through_train_py(tmp_path):
    """experiment=v6_dpace with the γ-sweep drafters (D-PACE × γ = 4, 7, 10), one drafter
    with its own alpha and one normalised per slot: 3 steps, finite losses, settings saved."""
    train = make_shards(tmp_path / "train", n=12)
    ov = base_overrides(tmp_path, train) + [
        "experiment=v6_dpace", "drafters=gamma_sweep", "+drafters.gamma4.loss.alpha=0.3",
        "+drafters.gamma10.loss.normalize=slots", "trainer.max_steps=3",
    ]
    run_train(ov, tmp_path / "run")
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    names = ("gamma4", "gamma7", "gamma10")
    for n in names:
        vals = [float(r[f"train/{n}/loss"]) for r in rows if r.get(f"train/{n}/loss")]
        assert len(vals) == 3 and all(0 < v < 20 for v in vals), (n, vals)
    ck = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu",
                    weights_only=True)
    saved = {n: ck["dflash"]["drafters"][n]["loss"] for n in names}
    assert {s["name"] for s in saved.values()} == {"dpace"}
    assert [saved[n]["gamma"] for n in names] == [4.0, 7.0, 10.0]
    assert saved["gamma4"]["alpha"] == 0.3 and saved["gamma7"]["alpha"] == 0.5
    assert saved["gamma10"]["normalize"] == "slots"


def test_distillation_from_a_cache_stores_topk_and_refuses_reverse_kl(tmp_path):
    """loss=jsd with a second drafter on tv, features=cache: the cache is built with the
    target's top-64 logits and both drafters train on them; reverse KL is refused up front."""
    from dflash_lit.data.features import read_manifest

    train = make_shards(tmp_path / "train", n=12)
    ov = base_overrides(tmp_path, train) + [
        "loss=jsd", "+drafters.tvd.loss.divergence=tv", "features=cache", "trainer.max_steps=2",
    ]
    run_train(ov, tmp_path / "run")
    caches = [p for p in (tmp_path / "outputs" / "features").iterdir() if p.is_dir()]
    assert [read_manifest(c)["fingerprint"]["topk"] for c in caches] == [64]
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for n in ("main", "tvd"):
        vals = [float(r[f"train/{n}/loss"]) for r in rows if r.get(f"train/{n}/loss")]
        assert len(vals) == 2 and all(0 < v < 20 for v in vals), (n, vals)
    with pytest.raises(UserError, match="drafters.main.loss.divergence=reverse_kl"):
        run_train(base_overrides(tmp_path, train) + ["loss=reverse_kl", "features=cache"],
                  tmp_path / "refused")
