"""Losses: hand-computed values, explicit loop references, masking, config factory."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_lit.train.losses import (
    IGNORE,
    CompositeLoss,
    HardCELoss,
    build_loss,
    composite_loss,
    hard_ce_loss,
    position_weights,
    streak_weights,
    target_argmax_labels,
)

I = IGNORE  # noqa: E741


# --------------------------------------------------------------------------- references
def _log_softmax(row: list[float], t: float = 1.0) -> list[float]:
    z = [x / t for x in row]
    m = max(z)
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    return [x - lse for x in z]


def _ref_hard_ce(logits: torch.Tensor, labels: torch.Tensor, gamma: float | None) -> float:
    b, n, bs, _ = logits.shape
    num = den = 0.0
    for i in range(b):
        for j in range(n):
            for k in range(1, bs):
                y = int(labels[i, j, k])
                if y == I:
                    continue
                w = 1.0 if gamma is None else math.exp(-(k - 1) / gamma)
                ce = -_log_softmax(logits[i, j, k].double().tolist())[y]
                num += w * ce
                den += w
    return num / den


def _ref_composite(logits, labels, target, gamma, kl_w, ce_w, t, streak_aware) -> float:
    b, n, bs, v = logits.shape
    num = den = 0.0
    for i in range(b):
        for j in range(n):
            s = 1.0  # probability slots 1..k-1 were all right
            for k in range(1, bs):
                y = int(labels[i, j, k])
                if y == I:
                    continue
                d_row = logits[i, j, k].double().tolist()
                lq = _log_softmax(d_row)
                lq_t = _log_softmax(d_row, t)
                lp_t = _log_softmax(target[i, j, k].double().tolist(), t)
                kl = sum(math.exp(lp_t[c]) * (lp_t[c] - lq_t[c]) for c in range(v)) * t * t
                ce = -lq[y]
                w = math.exp(-(k - 1) / gamma) * (s if streak_aware else 1.0)
                num += w * (kl_w * kl + ce_w * ce)
                den += w
                s *= math.exp(lq[y])
    return num / den


def _random_batch(seed: int, b=2, n=3, bs=5, v=7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, n, bs, v, generator=g) * 2
    target = torch.randn(b, n, bs, v, generator=g) * 2
    labels = torch.randint(0, v, (b, n, bs), generator=g)
    labels[..., 0] = I
    labels[0, 2] = I  # a padding block
    labels[1, 0, 3:] = I  # block running past the sequence end
    labels[1, 1, 2] = I  # a prompt token inside a block
    return logits, labels, target


# --------------------------------------------------------------------------- position weights
def test_position_weights_values():
    w = position_weights(5, 2.0)
    expected = [0.0, 1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]
    assert w.dtype == torch.float32
    assert w.tolist() == pytest.approx(expected, abs=1e-7)
    assert position_weights(4, None).tolist() == [0.0, 1.0, 1.0, 1.0]
    assert position_weights(4, math.inf).tolist() == [0.0, 1.0, 1.0, 1.0]
    assert position_weights(3, 7).tolist() == pytest.approx([0.0, 1.0, math.exp(-1 / 7)], abs=1e-7)


@pytest.mark.parametrize("gamma", [0, -1.0, float("nan"), "7", True])
def test_position_weights_rejects_bad_gamma(gamma):
    with pytest.raises(ValueError, match="loss.gamma"):
        position_weights(4, gamma)


def test_position_weights_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        position_weights(1, 7.0)


# --------------------------------------------------------------------------- hard CE
def _hand_example():
    # one block, Bs=4, V=3. slot 0: garbage logits + a label (must be ignored anyway);
    # slot 1: [2,0,0] label 0; slot 2: [0,0,0] label 1; slot 3: -100 with garbage logits.
    logits = torch.tensor(
        [[[[50.0, -50.0, 3.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [9.0, -9.0, 0.0]]]]
    )
    labels = torch.tensor([[[2, 0, 1, I]]])
    return logits, labels


def test_hard_ce_hand_computed():
    logits, labels = _hand_example()
    out = hard_ce_loss(logits, labels, gamma=1.0)
    ce1 = math.log(1 + 2 * math.exp(-2))  # -log(e^2 / (e^2 + 2))
    ce2 = math.log(3)
    w2 = math.exp(-1)
    assert out.loss.item() == pytest.approx((ce1 + w2 * ce2) / (1 + w2), abs=1e-6)
    assert out.weight_sum.item() == pytest.approx(1 + w2, abs=1e-6)
    assert int(out.n_valid) == 2
    assert out.per_slot_ce[0, 0].tolist() == pytest.approx([0.0, ce1, ce2, 0.0], abs=1e-6)
    # no decay: plain mean of the two valid CEs
    flat = hard_ce_loss(logits, labels, gamma=None)
    assert flat.loss.item() == pytest.approx((ce1 + ce2) / 2, abs=1e-6)


@pytest.mark.parametrize("gamma", [None, 1.0, 4.0, 7.0])
def test_hard_ce_matches_loop_reference(gamma):
    logits, labels, _ = _random_batch(0)
    out = hard_ce_loss(logits, labels, gamma)
    assert out.loss.item() == pytest.approx(_ref_hard_ce(logits, labels, gamma), abs=1e-6)
    w = position_weights(5, gamma)
    valid = labels != I
    assert out.weight_sum.item() == pytest.approx(
        float((w.expand_as(labels) * valid).sum()), abs=1e-6
    )
    assert int(out.n_valid) == int(valid.sum())


def test_hard_ce_ignores_invalid_slots_even_nan():
    logits, labels, _ = _random_batch(1)
    ref = hard_ce_loss(logits, labels, 7.0).loss
    poisoned = logits.clone()
    poisoned[..., 0, :] = float("nan")  # slot 0
    poisoned[labels == I] = float("nan")  # every ignored slot
    out = hard_ce_loss(poisoned, labels, 7.0)
    assert torch.isfinite(out.loss)
    assert out.loss.item() == pytest.approx(ref.item(), abs=1e-6)


def test_hard_ce_gradient_only_on_valid_slots():
    logits, labels, _ = _random_batch(2)
    logits.requires_grad_(True)
    hard_ce_loss(logits, labels, 7.0).loss.backward()
    invalid = labels == I
    assert logits.grad[invalid].abs().max().item() == 0.0
    assert logits.grad[~invalid].abs().sum(-1).min().item() > 0.0


def test_hard_ce_bf16_computed_in_float32():
    logits, labels, _ = _random_batch(3)
    lb = logits.bfloat16()
    out = hard_ce_loss(lb, labels, 7.0)
    assert out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(
        hard_ce_loss(lb.float(), labels, 7.0).loss.item(), abs=1e-6
    )


def test_hard_ce_all_invalid_is_zero_and_differentiable():
    logits = torch.randn(1, 2, 4, 5, requires_grad=True)
    labels = torch.full((1, 2, 4), I)
    out = hard_ce_loss(logits, labels, 7.0)
    assert out.loss.item() == 0.0 and int(out.n_valid) == 0
    out.loss.backward()
    assert logits.grad.abs().max().item() == 0.0


def test_hard_ce_shape_errors():
    with pytest.raises(ValueError, match=r"\[B, N, Bs, V\]"):
        hard_ce_loss(torch.randn(2, 4, 5), torch.zeros(2, 4, dtype=torch.long), 7.0)
    with pytest.raises(ValueError, match="labels shape"):
        hard_ce_loss(torch.randn(1, 2, 4, 5), torch.zeros(1, 2, 3, dtype=torch.long), 7.0)
    with pytest.raises(TypeError, match="int64"):
        hard_ce_loss(torch.randn(1, 2, 4, 5), torch.zeros(1, 2, 4), 7.0)


# --------------------------------------------------------------------------- target argmax
def test_target_argmax_labels():
    target = torch.tensor([[[[0.0, 1.0, 0.0], [3.0, 1.0, 2.0], [0.0, 0.0, 5.0], [1.0, 9.0, 0.0]]]])
    labels = torch.tensor([[[0, 2, 2, I]]])  # slot 0 carries a label: still -100 out
    out = target_argmax_labels(target, labels)
    assert out.tolist() == [[[I, 0, 2, I]]]
    logits, labels, target = _random_batch(4)
    out = target_argmax_labels(target, labels)
    valid = labels != I
    assert torch.equal(out[valid], target.argmax(-1)[valid])
    assert (out[~valid] == I).all()
    with pytest.raises(ValueError, match="loss.labels"):
        target_argmax_labels(None, labels)


# --------------------------------------------------------------------------- composite
def test_streak_weights_hand():
    # slot log-probs of the label: slot1 log .5, slot2 invalid, slot3 log .25, slot4 log .1
    lp = torch.tensor([[[0.0, math.log(0.5), 123.0, math.log(0.25), math.log(0.1)]]])
    valid = torch.tensor([[[False, True, False, True, True]]])
    s = streak_weights(lp, valid)
    assert s[0, 0].tolist() == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.125], abs=1e-7)


def test_composite_kl_hand_computed():
    # one valid slot, V=2: target [0, ln 3], draft [0, 0]; only the KL term (ce_weight=0).
    logits = torch.zeros(1, 1, 2, 2)
    target = torch.tensor([[[[0.0, 0.0], [0.0, math.log(3.0)]]]])
    labels = torch.tensor([[[I, 1]]])
    for t in (1.0, 2.0):
        out = composite_loss(logits, labels, target, kl_weight=1.0, ce_weight=0.0, temperature=t)
        p1 = 3 ** (1 / t) / (1 + 3 ** (1 / t))
        p = [1 - p1, p1]
        kl = sum(pi * math.log(pi / 0.5) for pi in p) * t * t
        assert out.loss.item() == pytest.approx(kl, abs=1e-6)
        assert out.per_slot_kl[0, 0, 1].item() == pytest.approx(kl, abs=1e-6)
    # identical distributions: KL = 0, the loss is the 0.3-weighted CE = 0.3 * ln 2
    out = composite_loss(logits, labels, torch.zeros_like(logits))
    assert out.loss.item() == pytest.approx(0.3 * math.log(2), abs=1e-6)


@pytest.mark.parametrize("streak_aware", [True, False])
@pytest.mark.parametrize("t", [1.0, 2.0])
def test_composite_matches_loop_reference(streak_aware, t):
    logits, labels, target = _random_batch(5)
    out = composite_loss(
        logits, labels, target, gamma=10.0, temperature=t, streak_aware=streak_aware
    )
    ref = _ref_composite(logits, labels, target, 10.0, 0.7, 0.3, t, streak_aware)
    assert out.loss.item() == pytest.approx(ref, abs=1e-6)


def _ref_composite_torch(logits, labels, target, gamma=10.0, t=2.0):
    """Per-slot torch loop with s_k built from detached probabilities (for gradients)."""
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
                lq_t = torch.log_softmax(d / t, -1)
                lp_t = torch.log_softmax(target[i, j, k].double() / t, -1)
                kl = (lp_t.exp() * (lp_t - lq_t)).sum() * t * t
                ce = -torch.log_softmax(d, -1)[y]
                w = math.exp(-(k - 1) / gamma) * s
                num = num + w * (0.7 * kl + 0.3 * ce)
                den += w
                s *= math.exp(-ce.item())  # a python float: no gradient through s
    return num / den


def test_composite_gradient_treats_streak_weights_as_constants():
    logits, labels, target = _random_batch(6, b=2, n=3, bs=4, v=5)
    poisoned_t = target.clone()
    poisoned_t[labels == I] = float("nan")
    lg = logits.clone().requires_grad_(True)
    out = composite_loss(lg, labels, poisoned_t)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert lg.grad[labels == I].abs().max().item() == 0.0
    lg_ref = logits.clone().requires_grad_(True)
    ref = _ref_composite_torch(lg_ref, labels, target)
    ref.backward()
    assert out.loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(lg.grad, lg_ref.grad.float(), atol=1e-6)


def test_composite_needs_target():
    logits, labels, _ = _random_batch(7)
    with pytest.raises(ValueError, match="composite needs the target"):
        composite_loss(logits, labels, None)
    with pytest.raises(ValueError, match="loss.temperature"):
        composite_loss(logits, labels, logits, temperature=0.0)
    with pytest.raises(ValueError, match="loss.kl_weight"):
        composite_loss(logits, labels, logits, kl_weight=0.0, ce_weight=0.0)


# --------------------------------------------------------------------------- factory
def test_build_loss_from_config():
    logits, labels, target = _random_batch(8)
    fn = build_loss(**{"name": "hard_ce", "gamma": 7, "labels": "target_argmax"})
    assert isinstance(fn, HardCELoss) and fn.needs_target_logits
    expected = hard_ce_loss(logits, target_argmax_labels(target, labels), 7.0).loss
    assert fn(logits, labels, target).loss.item() == pytest.approx(expected.item(), abs=1e-7)
    data = build_loss("hard_ce", gamma=4.0, labels="data")
    assert not data.needs_target_logits
    assert data(logits, labels, None).loss.item() == pytest.approx(
        _ref_hard_ce(logits, labels, 4.0), abs=1e-6
    )
    assert build_loss("hard_ce").labels == "target_argmax"  # the v5 default (conf/loss/hard_ce.yaml)
    with pytest.raises(ValueError, match="loss.labels=target_argmax"):
        fn(logits, labels, None)


def test_build_composite_from_config():
    logits, labels, target = _random_batch(9)
    fn = build_loss("composite", gamma=10, temperature=2.0)
    assert isinstance(fn, CompositeLoss) and fn.needs_target_logits
    ref = _ref_composite(logits, labels, target, 10.0, 0.7, 0.3, 2.0, True)
    assert fn(logits, labels, target).loss.item() == pytest.approx(ref, abs=1e-6)
    with pytest.raises(ValueError, match="composite needs the target"):
        fn(logits, labels, None)


def test_build_loss_errors():
    with pytest.raises(ValueError, match="unknown loss"):
        build_loss("focal")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['temperature'\]"):
        build_loss("hard_ce", temperature=2.0)
    with pytest.raises(ValueError, match="loss.labels"):
        build_loss("hard_ce", labels="argmax")
    with pytest.raises(ValueError, match="loss.gamma"):
        build_loss("hard_ce", gamma=0)
