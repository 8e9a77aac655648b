"""The fused lm_head + hard CE equals the plain path: loss, per-slot CE, argmax and the
gradient w.r.t. the drafter's hidden states, at any chunk size; bf16 matmuls stay within a
stated tolerance of fp32."""

from __future__ import annotations

import pytest
import torch

from dflash_lit.data.frequent_tokens import frequent_tokens
from dflash_lit.model.layout import IGNORE
from dflash_lit.train.linear_ce import fused_hard_ce, linear_cross_entropy, restrict_vocab
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
    assert float(out.loss.detach()) == 0.0 and float(h.grad.abs().sum()) == 0.0


def test_trainable_weight_is_refused():
    hidden, weight, labels = _case()
    with pytest.raises(ValueError, match="frozen"):
        linear_cross_entropy(hidden.flatten(0, 2), weight.requires_grad_(True),
                             labels.flatten().clamp(min=0), torch.ones(labels.numel()))


def test_reduced_vocab_equals_plain_ce_over_those_rows_and_keeps_every_label():
    """A softmax over vocab ∪ labels: loss and gradient equal the plain CE of the logits of
    exactly those ids; a label outside ``vocab`` is added, not dropped."""
    hidden, weight, labels = _case(seed=3, v=40)
    vocab = torch.tensor([0, 2, 5, 9])
    w_sub, sub, ids = restrict_vocab(weight, labels, vocab)
    valid = labels != IGNORE
    valid[..., 0] = False  # slot 0 is the given anchor, never a label
    expect = sorted(set(vocab.tolist()) | set(labels[valid].tolist()))
    assert ids.tolist() == expect
    assert torch.equal(ids[sub[valid]], labels[valid])  # renumbered, same tokens
    assert bool((sub[~valid] == IGNORE).all())
    h1 = hidden.clone().requires_grad_(True)
    keep = torch.tensor(expect)
    ref = hard_ce_loss((h1 @ weight.T)[..., keep], sub, gamma=7.0)
    ref.loss.backward()
    h2 = hidden.clone().requires_grad_(True)
    out, pred = fused_hard_ce(h2, w_sub, sub, gamma=7.0, chunk_rows=4)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-7)
    # with every id in the vocab it is the full CE
    full, _ = fused_hard_ce(hidden, *restrict_vocab(weight, labels, torch.arange(40))[:2], gamma=7.0)
    torch.testing.assert_close(full.loss, hard_ce_loss(hidden @ weight.T, labels, gamma=7.0).loss)


def test_frequent_tokens_rank_completion_tokens_then_lower_ids():
    rows = [{"input_ids": [7, 7, 3, 3, 3, 1], "loss_mask": [0, 0, 1, 1, 1, 1]},
            {"input_ids": [8, 8, 5], "loss_mask": [1, 1, 0]}]

    class Rows(list):
        def __getitems__(self, idx):
            return [self[i] for i in idx]

    # counts over completions: 3 -> 3, 8 -> 2, 1 -> 1; prompt-only 7 and 5 count 0
    assert frequent_tokens(Rows(rows), 3, vocab_size=10).tolist() == [1, 3, 8]
    assert frequent_tokens(Rows(rows), 4, vocab_size=10).tolist() == [0, 1, 3, 8]  # tie: id 0
    with pytest.raises(ValueError, match="train_vocab=11"):
        frequent_tokens(Rows(rows), 11, vocab_size=10)
