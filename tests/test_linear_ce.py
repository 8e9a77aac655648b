"""The fused lm_head + hard CE equals the plain path: loss, per-slot CE, argmax and the
gradient w.r.t. the drafter's hidden states, at any chunk size; bf16 matmuls stay within a
stated tolerance of fp32."""

from __future__ import annotations

import pytest
import torch

from dflash_lit.model.layout import IGNORE
from dflash_lit.train.linear_ce import fused_hard_ce, linear_cross_entropy
from dflash_lit.train.losses import hard_ce_loss


def _case(seed=0, b=2, n=3, bs=5, d=16, v=50):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n, bs, d, generator=g)
    weight = torch.randn(v, d, generator=g) * 0.5
    labels = torch.randint(0, v, (b, n, bs), generator=g)
    labels[0, 1, 3:] = IGNORE  # past the end
    labels[1, 2] = IGNORE  # an invalid block
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_fused_equals_plain_loss_and_gradient(chunk):
    hidden, weight, labels = _case()
    h1 = hidden.clone().requires_grad_(True)
    ref = hard_ce_loss(h1 @ weight.T, labels, gamma=7.0)
    ref.loss.backward()
    h2 = hidden.clone().requires_grad_(True)
    out, pred = fused_hard_ce(h2, weight, labels, gamma=7.0, chunk_rows=chunk)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.per_slot_ce, ref.per_slot_ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.weight_sum, ref.weight_sum)
    assert int(out.n_valid) == int(ref.n_valid)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-7)
    valid = (labels != IGNORE)
    valid[..., 0] = False
    assert torch.equal(pred[valid], (hidden @ weight.T).argmax(-1)[valid])
    assert bool((pred[~valid] == IGNORE).all())


def test_fused_scales_with_upstream_gradient():
    hidden, weight, labels = _case(seed=1)
    h1 = hidden.clone().requires_grad_(True)
    (3.0 * hard_ce_loss(h1 @ weight.T, labels, gamma=None).loss).backward()
    h2 = hidden.clone().requires_grad_(True)
    (3.0 * fused_hard_ce(h2, weight, labels, gamma=None, chunk_rows=3)[0].loss).backward()
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-7)


def test_bf16_matmul_within_tolerance():
    """bf16 matmuls (8-bit mantissa) move the loss by well under 1 %: the stated tolerance."""
    hidden, weight, labels = _case(seed=2, d=64, v=300)
    ref = hard_ce_loss(hidden @ weight.T, labels, gamma=7.0)
    out, _ = fused_hard_ce(hidden, weight, labels, gamma=7.0, compute_dtype=torch.bfloat16)
    assert abs(float(out.loss) - float(ref.loss)) / float(ref.loss) < 1e-2


def test_no_valid_slot_gives_zero_attached_loss():
    hidden, weight, labels = _case()
    labels[:] = IGNORE
    h = hidden.clone().requires_grad_(True)
    out, _ = fused_hard_ce(h, weight, labels, gamma=7.0)
    out.loss.backward()
    assert float(out.loss) == 0.0 and float(h.grad.abs().sum()) == 0.0


def test_trainable_weight_is_refused():
    hidden, weight, labels = _case()
    with pytest.raises(ValueError, match="frozen"):
        linear_cross_entropy(hidden.flatten(0, 2), weight.requires_grad_(True),
                             labels.flatten().clamp(min=0), torch.ones(labels.numel()))
