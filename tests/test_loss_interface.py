"""The loss interface: a new divergence is one class plus one YAML, every loss runs fused with
the frozen lm_head and equals its materialised form (loss, per-slot terms, gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from train_utils import base_overrides, compose_train, make_shards

from dflash_lit.errors import UserError
from dflash_lit.model.layout import IGNORE
from dflash_lit.train.divergences import (
    DIVERGENCE_REGISTRY,
    Divergence,
    plogp_ratio,
    register_divergence,
)
from dflash_lit.train.linear_ce import fused_head_loss
from dflash_lit.train.losses import DistillLoss, build_loss


class SkewKL(Divergence):
    """KL(p ‖ α·p + (1−α)·q), α = 0.1: a forward KL that stays finite where q → 0."""

    name = "skew_kl"
    alpha = 0.1

    def __call__(self, log_q, log_p):
        mix = torch.logaddexp(log_p + torch.log(torch.tensor(self.alpha)),
                              log_q + torch.log(torch.tensor(1 - self.alpha)))
        return plogp_ratio(log_p, mix)


@pytest.fixture
def skew_kl():
    register_divergence(SkewKL)
    yield SkewKL
    DIVERGENCE_REGISTRY.pop(SkewKL.name)


def _case(seed=0, b=2, n=3, bs=5, d=16, v=40, s=12):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n, bs, d, generator=g)
    weight = torch.randn(v, d, generator=g) * 0.5
    labels = torch.randint(0, v, (b, n, bs), generator=g)
    labels[0, 1, 3:] = IGNORE
    labels[1, 2] = IGNORE
    target = torch.randn(b, s, v, generator=g) * 2
    positions = torch.randint(0, s, (b, n, bs), generator=g)
    return hidden, weight, labels, target, positions


def _materialised(loss, hidden, weight, labels, target, positions):
    h = hidden.clone().requires_grad_(True)
    gathered = target[torch.arange(target.shape[0])[:, None, None], positions]
    out = loss.with_labels(h @ weight.T, labels, gathered)
    out.loss.backward()
    return out, h.grad


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd", "tv", "skew_kl"])
@pytest.mark.parametrize("streak_aware", [False, True])
def test_every_divergence_runs_fused_and_equals_its_materialised_form(skew_kl, divergence,
                                                                     streak_aware):
    hidden, weight, labels, target, positions = _case()
    loss = DistillLoss(divergence, gamma=4.0, div_weight=0.6, ce_weight=0.4, temperature=1.5,
                       streak_aware=streak_aware, labels="data")
    ref, ref_grad = _materialised(loss, hidden, weight, labels, target, positions)
    h = hidden.clone().requires_grad_(True)
    out, pred = fused_head_loss(loss, h, weight, labels, target, positions, chunk_rows=7,
                                compute_dtype=torch.float32)
    (2.0 * out.loss).backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.per_slot_kl, ref.per_slot_kl, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.per_slot_ce, ref.per_slot_ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.weight_sum, ref.weight_sum)
    torch.testing.assert_close(h.grad, 2.0 * ref_grad, rtol=1e-4, atol=1e-6)
    valid = labels != IGNORE
    valid[..., 0] = False
    assert torch.equal(pred[valid], (hidden @ weight.T).argmax(-1)[valid])
    assert (pred[~valid] == IGNORE).all()


def test_a_registered_divergence_is_computed_as_written(skew_kl):
    """The registered class is what the loss computes: KL(p‖0.1p+0.9q) by hand, and it
    differs from the forward KL."""
    hidden, weight, labels, target, positions = _case(seed=3)
    gathered = target[torch.arange(2)[:, None, None], positions]
    logits = hidden @ weight.T
    out = build_loss("distill", divergence="skew_kl", gamma=None, labels="data")(
        logits, labels, gathered)
    valid = labels != IGNORE
    valid[..., 0] = False
    p = F.softmax(gathered[valid], -1)
    q = F.softmax(logits[valid], -1)
    expected = (p * (p.log() - (0.1 * p + 0.9 * q).log())).sum(-1).mean()
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    fkl = build_loss("distill", divergence="forward_kl", gamma=None, labels="data")(
        logits, labels, gathered)
    assert abs(fkl.loss.item() - out.loss.item()) > 0.1


def test_an_unregistered_divergence_is_a_one_line_user_error():
    with pytest.raises(UserError, match=r"loss.divergence='skew_kl': must be one of") as e:
        build_loss("distill", divergence="skew_kl")
    assert "\n" not in str(e.value)


def test_a_new_divergence_trains_from_one_yaml(skew_kl, tmp_path):
    """One class (registered above) and one YAML in a config search path: ``loss=skew_kl``
    composes, the training module builds it, its fused training path and its materialised
    validation path agree, and a cache of the target's top-k serves it."""
    from dflash_lit.train.run import build_run

    conf = tmp_path / "conf" / "loss"
    conf.mkdir(parents=True)
    (conf / "skew_kl.yaml").write_text(
        "# KL(p ‖ 0.1p + 0.9q) per slot, with a little CE\n"
        "name: distill            # loss registry name\n"
        "divergence: skew_kl      # the registered class\n"
        "div_weight: 0.8          # weight of the T²-scaled divergence\n"
        "ce_weight: 0.2           # weight of the hard-label CE\n"
        "temperature: 1.0         # softmax temperature T\n"
        "gamma: 4.0               # position decay γ\n"
        "streak_aware: false      # no streak weights\n"
        "labels: target_argmax    # CE labels\n")
    data = make_shards(tmp_path / "train", n=8)
    cfg = compose_train(base_overrides(tmp_path, data) + [
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "loss=skew_kl", "features=cache"],
        tmp_path / "r")
    assert cfg.loss.divergence == "skew_kl"
    module, dm, _ = build_run(cfg)
    assert isinstance(module.losses["main"], DistillLoss)
    batch = next(iter(dm.train_dataloader()))
    assert "target_topk_logits" in batch  # the cache stored the top-k this loss needs
    out = module._target_forward(batch)
    layout, _, hidden = module._draft("main", batch, out, 0, train=False)
    results = []
    for need_logits in (False, True):
        h = hidden.detach().requires_grad_(True)
        pred, _, lo = module._head_loss("main", layout, h, out, need_logits=need_logits)
        assert pred.dim() == (4 if need_logits else 3)
        lo.loss.backward()
        results.append((lo, h.grad))
    (fused, g_fused), (mat, g_mat) = results
    assert fused.loss.item() > 0
    torch.testing.assert_close(fused.loss, mat.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.per_slot_kl, mat.per_slot_kl, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g_fused, g_mat, rtol=1e-4, atol=1e-7)
