"""Offline metrics: crafted patterns, explicit references, tree-vs-chain relations, torchmetrics."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_lit.eval.ddtree import accepted_length, build_ddtree
from dflash_lit.train.losses import IGNORE, hard_ce_loss
from dflash_lit.train.metrics import (
    DrafterMetrics,
    accuracy,
    accuracy_per_position,
    block_correct,
    offline_tree_acceptance,
    streak,
    streak_lengths,
    topk_log_probs,
    tree_acceptance_lengths,
)

I = IGNORE  # noqa: E741


def _crafted():
    """B=1, N=6, Bs=4, V=3. Predictions are one-hot argmaxes; 'c' correct, 'w' wrong, '-' invalid.

    block 0: c c w  -> streak 2      block 3: c c c -> 3
    block 1: c w c  -> 1             block 4: c - c -> 1 (stops at the invalid slot)
    block 2: w c c  -> 0             block 5: - - - -> padding, not a block
    """
    patterns = ["ccw", "cwc", "wcc", "ccc", "c-c", "---"]
    labels = torch.full((1, 6, 4), I)
    preds = torch.zeros((1, 6, 4), dtype=torch.long)
    for n, pat in enumerate(patterns):
        for k, ch in enumerate(pat, start=1):
            if ch == "-":
                continue
            labels[0, n, k] = (n + k) % 3
            preds[0, n, k] = labels[0, n, k] if ch == "c" else (labels[0, n, k] + 1) % 3
    logits = torch.nn.functional.one_hot(preds, 3).float() * 4.0
    logits[0, :, 0] = torch.tensor([0.0, 9.0, 0.0])  # slot 0: ignored whatever it says
    return logits, labels


def test_crafted_accuracy_and_streak():
    logits, labels = _crafted()
    correct = block_correct(logits, labels)
    assert correct[0, :, 1:].int().tolist() == [
        [1, 1, 0],
        [1, 0, 1],
        [0, 1, 1],
        [1, 1, 1],
        [1, 0, 1],
        [0, 0, 0],
    ]
    assert not correct[..., 0].any()
    # 14 valid slots, 11 correct
    assert accuracy(logits, labels).item() == pytest.approx(11 / 14, abs=1e-12)
    acc_pos = accuracy_per_position(logits, labels)
    assert math.isnan(acc_pos[0])
    assert acc_pos[1:].tolist() == pytest.approx([4 / 5, 3 / 4, 4 / 5], abs=1e-12)
    assert streak_lengths(logits, labels)[0].tolist() == [2, 1, 0, 3, 1, 0]
    assert streak(logits, labels).item() == pytest.approx((2 + 1 + 0 + 3 + 1) / 5, abs=1e-12)


def test_empty_batch_gives_nan():
    logits = torch.randn(1, 2, 4, 5)
    labels = torch.full((1, 2, 4), I)
    assert math.isnan(accuracy(logits, labels)) and math.isnan(streak(logits, labels))
    assert math.isnan(offline_tree_acceptance(logits, labels, 4))


def _random(seed: int, b=2, n=5, bs=6, v=6, temp=1.0, follow=0.7):
    """Random logits; labels follow the argmax with probability `follow` (long streaks)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, n, bs, v, generator=g) * temp
    top = logits.argmax(-1)
    second = logits.topk(2, -1).indices[..., 1]
    other = torch.randint(0, v, (b, n, bs), generator=g)
    r = torch.rand(b, n, bs, generator=g)
    labels = torch.where(r < follow, top, torch.where(r < follow + 0.15, second, other))
    labels[..., 0] = I
    labels[0, -1] = I  # padding block
    labels[1, 0, 4:] = I  # past the end
    return logits, labels


def _ref_tree(logits, labels, budget, topk):
    """Per-block scalar DDTree + walk along the labels: the reference for the batched metric."""
    b, n, bs, _ = logits.shape
    out = torch.zeros(b, n, dtype=torch.long)
    for i in range(b):
        for j in range(n):
            if not (labels[i, j, 1:] != I).any():
                continue
            lp = torch.log_softmax(logits[i, j, 1:].float(), -1)
            vals, ids = lp.topk(topk, -1)
            tree = build_ddtree(vals, ids, budget)
            row = labels[i, j].tolist()

            def choice(r, depth, row=row):
                return row[depth + 1] if depth + 1 < bs and row[depth + 1] != I else None

            out[i, j] = accepted_length(tree, choice)
    return out


@pytest.mark.parametrize("budget,topk", [(1, 2), (3, 2), (5, 3), (8, 4), (20, None)])
def test_tree_acceptance_matches_scalar_reference(budget, topk):
    logits, labels = _random(0)
    k = budget if topk is None else topk
    got = tree_acceptance_lengths(logits, labels, budget, topk)
    assert torch.equal(got, _ref_tree(logits, labels, budget, min(k, 6)))
    valid_blocks = (labels != I).any(-1)
    assert offline_tree_acceptance(logits, labels, budget, topk).item() == pytest.approx(
        got[valid_blocks].double().mean().item(), abs=1e-12
    )


def test_topk_log_probs_chunked():
    logits = torch.randn(3, 2, 4, 11)
    vals, ids = topk_log_probs(logits, 4, chunk_rows=5)
    ref = torch.log_softmax(logits, -1).topk(4, -1)
    assert torch.equal(ids, ref.indices)
    assert torch.allclose(vals, ref.values, atol=1e-6)
    with pytest.raises(ValueError, match="topk"):
        topk_log_probs(logits, 12)


def test_topk1_tree_is_the_truncated_chain():
    logits, labels = _random(1)
    s = streak_lengths(logits, labels)
    for budget in (1, 2, 3, 5, 9):
        got = tree_acceptance_lengths(logits, labels, budget, topk=1)
        assert torch.equal(got, s.clamp(max=budget))


def _chain_depth_in_tree(logits, budget, topk):
    """[B, N] depth reached by the all-rank-0 (greedy) chain inside each block's tree."""
    b, n = logits.shape[:2]
    out = torch.zeros(b, n, dtype=torch.long)
    for i in range(b):
        for j in range(n):
            vals, ids = torch.log_softmax(logits[i, j, 1:], -1).topk(topk, -1)
            tree = build_ddtree(vals, ids, budget)
            on_chain: list[bool] = []
            for p, r in zip(tree.parents.tolist(), tree.ranks.tolist()):
                on_chain.append(r == 0 and (p == -1 or on_chain[p]))
            out[i, j] = sum(on_chain)
    return out


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_tree_vs_chain_relations_on_random_logits(seed):
    logits, labels = _random(seed, temp=2.0)
    bs = logits.shape[2]
    s = streak_lengths(logits, labels)
    valid = labels != I
    prev = None
    for budget in (1, 2, bs - 1, 8, 16):
        t = tree_acceptance_lengths(logits, labels, budget, topk=3)
        c = _chain_depth_in_tree(logits, budget, 3)
        assert (c >= 1).all()
        assert (t >= torch.minimum(s, c)).all()  # the chain part of the tree is still accepted
        assert (t <= budget).all() and (t <= bs - 1).all()
        if prev is not None:
            assert (t >= prev).all()  # trees are nested in the budget
        prev = t
    # whole tree (3 + 9 + ... nodes): the top-3 streak, which is >= the chain streak
    in_top3 = (labels[..., None] == logits.topk(3, -1).indices).any(-1) & valid
    top3_streak = torch.cumprod(in_top3[..., 1:].long(), -1).sum(-1)
    full = tree_acceptance_lengths(logits, labels, sum(3**d for d in range(1, bs)), topk=3)
    assert torch.equal(full, top3_streak)
    assert (full >= s).all()


def test_budget_bs_minus_1_can_lose_to_the_chain():
    # Bs=3 (2 drafted slots), V=3. Slot 1 probs [.5, .45, .05], slot 2 [.4, .3, .3]; labels =
    # argmax -> streak 2. Budget 2 = Bs-1: after (d1 r0, .5) the sibling (.45) beats the chain's
    # child (.5*.4 = .2), so the tree is two depth-1 nodes and accepts only 1.
    probs = torch.tensor([[[[1 / 3, 1 / 3, 1 / 3], [0.5, 0.45, 0.05], [0.4, 0.3, 0.3]]]])
    logits = probs.log()
    labels = torch.tensor([[[I, 0, 0]]])
    assert streak_lengths(logits, labels).item() == 2
    assert tree_acceptance_lengths(logits, labels, budget=2, topk=2).item() == 1
    assert tree_acceptance_lengths(logits, labels, budget=3, topk=2).item() == 2


# --------------------------------------------------------------------------- torchmetrics
def _batches(n_batches=3):
    return [_random(10 + i, b=2, n=4, bs=5, v=6) for i in range(n_batches)]


def _one_shot(batches, budgets):
    logits = torch.cat([lg for lg, _ in batches])
    labels = torch.cat([lb for _, lb in batches])
    out = {
        "loss": hard_ce_loss(logits, labels, 7.0).loss.double(),
        "acc": accuracy(logits, labels),
        "streak": streak(logits, labels),
    }
    for k, v in enumerate(accuracy_per_position(logits, labels).tolist()):
        if k:
            out[f"acc_pos/{k}"] = torch.tensor(v, dtype=torch.float64)
    for b in budgets:
        out[f"ddtree_b{b}"] = offline_tree_acceptance(logits, labels, b, topk=3)
    return out


def test_drafter_metrics_accumulate_equals_one_shot():
    batches = _batches()
    m = DrafterMetrics(block_size=5, tree_budgets=(2, 6), tree_topk=3)
    for logits, labels in batches:
        m.update(logits, labels, hard_ce_loss(logits, labels, 7.0))
    got, ref = m.compute(), _one_shot(batches, (2, 6))
    assert set(got) == {
        "loss",
        "acc",
        "streak",
        "acc_pos/1",
        "acc_pos/2",
        "acc_pos/3",
        "acc_pos/4",
        "ddtree_b2",
        "ddtree_b6",
    }
    for key, value in ref.items():
        assert got[key].item() == pytest.approx(value.item(), abs=1e-6), key
    m.reset()
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert math.isnan(m.compute()["acc"])


def test_drafter_metrics_scalar_loss_is_mean_of_updates():
    m = DrafterMetrics(block_size=5)
    for i, (logits, labels) in enumerate(_batches()):
        m.update(logits, labels, torch.tensor(float(i)))
    assert m.compute()["loss"].item() == pytest.approx(1.0, abs=1e-12)
    assert not any(k.startswith("ddtree") for k in m.compute())


def test_drafter_metrics_state_survives_state_dict():
    batches = _batches(4)
    m = DrafterMetrics(block_size=5, tree_budgets=(4,), tree_topk=2)
    for logits, labels in batches[:2]:
        m.update(logits, labels, hard_ce_loss(logits, labels, 7.0))
    sd = m.state_dict()
    for name in (
        "loss_sum",
        "loss_weight",
        "n_valid",
        "n_correct",
        "pos_correct",
        "pos_valid",
        "n_blocks",
        "streak_sum",
        "tree_sum",
    ):
        assert name in sd, name
    resumed = DrafterMetrics(block_size=5, tree_budgets=(4,), tree_topk=2)
    resumed.load_state_dict(sd)
    for metric in (m, resumed):
        for logits, labels in batches[2:]:
            metric.update(logits, labels, hard_ce_loss(logits, labels, 7.0))
    a, b = m.compute(), resumed.compute()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ref = _one_shot(batches, ())
    assert a["acc"].item() == pytest.approx(ref["acc"].item(), abs=1e-12)


def test_drafter_metrics_validation():
    with pytest.raises(ValueError, match="block_size"):
        DrafterMetrics(block_size=1)
    with pytest.raises(ValueError, match="tree_budgets"):
        DrafterMetrics(block_size=4, tree_budgets=(0,))
    m = DrafterMetrics(block_size=4)
    with pytest.raises(ValueError, match="block_size=4"):
        m.update(torch.randn(1, 1, 5, 3), torch.zeros(1, 1, 5, dtype=torch.long))
