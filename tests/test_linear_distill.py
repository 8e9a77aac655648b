"""The fused lm_head + forward-KL distillation equals the plain ``distill_loss`` /
``composite_loss`` path: loss, per-slot CE and KL, normaliser, argmax and the gradient w.r.t.
the drafter's hidden states, for full and top-k (cached) target logits, at any chunk size."""

from __future__ import annotations

import pytest
import torch
from test_linear_ce import _case as ce_case

from dflash_lit.model.layout import IGNORE
from dflash_lit.train.linear_distill import fused_forward_kl
from dflash_lit.train.losses import composite_loss, distill_loss


def _case(seed=0, b=2, n=3, bs=5, d=16, v=50, s=12, topk=None):
    """test_linear_ce's case plus the target's logits [B, S, V] and each slot's position."""
    hidden, weight, labels = ce_case(seed, b, n, bs, d, v)
    g = torch.Generator().manual_seed(seed + 1000)
    target = torch.randn(b, s, v, generator=g) * 2
    if topk is not None:  # what a feature cache keeps: the top-k logits, -inf elsewhere
        vals, ids = target.topk(topk, dim=-1)
        target = torch.full_like(target, float("-inf")).scatter(-1, ids, vals)
    positions = torch.randint(0, s, (b, n, bs), generator=g)
    return hidden, weight, labels, target, positions


def _gathered(target, positions):
    """[B, S, V] -> [B, N, Bs, V] as ``gather_target_logits`` does."""
    b, n, bs = positions.shape
    idx = positions.flatten(1)[:, :, None].expand(-1, -1, target.shape[-1])
    return torch.gather(target, 1, idx).view(b, n, bs, -1)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("ce_weight,streak_aware,topk", [
    (0.3, True, None), (0.0, False, None), (0.3, True, 8), (1.0, False, 8)])
def test_fused_equals_plain(chunk, temperature, ce_weight, streak_aware, topk):
    hidden, weight, labels, target, positions = _case(topk=topk)
    h1 = hidden.clone().requires_grad_(True)
    ref = distill_loss(h1 @ weight.T, labels, _gathered(target, positions), "forward_kl", 10.0,
                       0.7, ce_weight, temperature, streak_aware)
    ref.loss.backward()
    h2 = hidden.clone().requires_grad_(True)
    out, pred = fused_forward_kl(h2, weight, labels, target, positions, 10.0, 0.7, ce_weight,
                                 temperature, streak_aware, chunk_rows=chunk)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.per_slot_ce, ref.per_slot_ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.per_slot_kl, ref.per_slot_kl, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.weight_sum, ref.weight_sum)
    assert int(out.n_valid) == int(ref.n_valid)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-4, atol=1e-6)
    valid = labels != IGNORE
    valid[..., 0] = False
    assert torch.equal(pred[valid], (hidden @ weight.T).argmax(-1)[valid])
    assert bool((pred[~valid] == IGNORE).all())


def test_composite_and_upstream_scale():
    """The v3 composite (KL 0.7 / CE 0.3, T = 2, streak-aware, γ = 10) under a scaled upstream
    gradient, as a sum of drafters' losses hands it."""
    hidden, weight, labels, target, positions = _case(seed=3, topk=6)
    h1 = hidden.clone().requires_grad_(True)
    (3.0 * composite_loss(h1 @ weight.T, labels, _gathered(target, positions)).loss).backward()
    h2 = hidden.clone().requires_grad_(True)
    out, _ = fused_forward_kl(h2, weight, labels, target, positions, 10.0, 0.7, 0.3, 2.0, True,
                              chunk_rows=5)
    (3.0 * out.loss).backward()
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-4, atol=1e-6)


def test_bf16_matmul_within_tolerance():
    """bf16 lm_head matmuls move the loss by well under 1 % (the stated tolerance)."""
    hidden, weight, labels, target, positions = _case(seed=2, d=64, v=300, topk=16)
    ref = composite_loss(hidden @ weight.T, labels, _gathered(target, positions))
    out, _ = fused_forward_kl(hidden, weight, labels, target, positions, 10.0, 0.7, 0.3, 2.0,
                              True, compute_dtype=torch.bfloat16)
    assert abs(float(out.loss) - float(ref.loss)) / float(ref.loss) < 1e-2


def test_trainable_head_refused():
    hidden, weight, labels, target, positions = _case()
    with pytest.raises(ValueError, match="frozen"):
        fused_forward_kl(hidden, weight.requires_grad_(True), labels, target, positions, 7.0,
                         1.0, 0.0, 1.0, False)


@pytest.mark.parametrize("features", ["online", "cache"])
def test_module_fused_path_equals_materialised(tmp_path, features):
    """The training module's composite drafter: the fused path (training) and the
    materialised one (validation with tree metrics) give the same loss and drafter gradient,
    on full target logits (online) and on a cache's top-64."""
    from train_utils import base_overrides, compose_train, make_shards

    from dflash_lit.train.run import build_run

    data = make_shards(tmp_path / "train", n=8)
    cfg = compose_train(base_overrides(tmp_path, data) + ["loss=composite",
                                                          f"features={features}"], tmp_path / "r")
    module, dm, _ = build_run(cfg)
    batch = next(iter(dm.train_dataloader()))
    out = module._target_forward(batch)
    layout, _, hidden = module._draft("main", batch, out, 0, train=False)
    grads, losses = [], []
    for need_logits in (False, True):
        module.drafters.zero_grad(set_to_none=True)
        h = hidden.detach().requires_grad_(True)
        pred, _, lo = module._head_loss("main", layout, h, out, need_logits=need_logits)
        assert pred.dim() == (3 if not need_logits else 4)  # fused: argmax ids, no logits
        lo.loss.backward()
        grads.append(h.grad)
        losses.append(lo)
    torch.testing.assert_close(losses[0].loss, losses[1].loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses[0].per_slot_kl, losses[1].per_slot_kl, rtol=1e-4,
                               atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_enclosing_autocast_leaves_fp32_dtypes_alone():
    """Training runs the loss under bf16 autocast; with an fp32 matmul dtype the fused loss
    must still equal the fp32 reference (autocast would round the KL's dot products)."""
    hidden, weight, labels, target, positions = _case(seed=4, d=32, v=200, topk=16)
    target = target * 5  # large logits: bf16 rounding of Σ p·z would show
    ref = composite_loss(hidden @ weight.T, labels, _gathered(target, positions))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = fused_forward_kl(hidden, weight, labels, target, positions, 10.0, 0.7, 0.3,
                                  2.0, True, compute_dtype=torch.float32)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.per_slot_kl, ref.per_slot_kl, rtol=1e-4, atol=1e-5)
