"""DDTree: hand-built best-first order, masks, acceptance, batched == scalar, top-b property."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash_lit.eval.ddtree import (
    accepted_length,
    accepted_path,
    batched_label_acceptance,
    build_ddtree,
    build_ddtree_batched,
    tree_attention_mask,
    tree_position_ids,
)


def _example():
    """3 depths, top-2: probs d1 [.6,.4], d2 [.7,.3], d3 [.8,.2]; tokens 10+, 20+, 30+."""
    probs = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.8, 0.2]], dtype=torch.float64)
    tokens = torch.tensor([[10, 11], [20, 21], [30, 31]])
    return probs.log(), tokens


def test_hand_built_best_first_order():
    # Path probabilities: A=(d1 r0) .6, B=A→(d2 r0) .42, C=(d1 r1) .4, D=B→(d3 r0) .336,
    # E=C→(d2 r0) .28, F=E→(d3 r0) .224, G=A→(d2 r1) .18, H=G→(d3 r0) .144, ...
    lp, tok = _example()
    tree = build_ddtree(lp, tok, budget=6)
    assert tree.parents.tolist() == [-1, 0, -1, 1, 2, 4]
    assert tree.depths.tolist() == [1, 2, 1, 3, 2, 3]
    assert tree.ranks.tolist() == [0, 0, 1, 0, 0, 0]
    assert tree.token_ids.tolist() == [10, 20, 11, 30, 20, 30]
    assert tree.scores.exp().tolist() == pytest.approx(
        [0.6, 0.42, 0.4, 0.336, 0.28, 0.224], abs=1e-12
    )
    # budget 8 adds G then H
    t8 = build_ddtree(lp, tok, budget=8)
    assert t8.parents.tolist()[6:] == [0, 6] and t8.ranks.tolist()[6:] == [1, 0]
    # the budget can exceed the whole tree (2 + 4 + 8 = 14 nodes)
    assert build_ddtree(lp, tok, budget=100).num_nodes == 14


def test_attention_mask_and_positions():
    lp, tok = _example()
    tree = build_ddtree(lp, tok, budget=6)
    mask = tree_attention_mask(tree)
    ancestors = [{0}, {0, 1}, {0, 1, 2}, {0, 3}, {0, 1, 2, 4}, {0, 3, 5}, {0, 3, 5, 6}]
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for row, cols in enumerate(ancestors):
        expected[row, list(cols)] = True
    assert torch.equal(mask, expected)
    assert tree_position_ids(tree, 100).tolist() == [100, 101, 102, 101, 103, 102, 103]


def test_accepted_length_per_node_and_callable():
    lp, tok = _example()
    tree = build_ddtree(lp, tok, budget=6)
    # target's greedy choice per mask row: root→11 (node C=2), C→20 (E=4), E→31 (absent)
    choice = [11, 99, 99, 20, 99, 31, 99]
    assert accepted_path(tree, choice) == [2, 4]
    assert accepted_length(tree, torch.tensor(choice)) == 2
    # root→10, A→20, B→30: the whole greedy chain
    assert accepted_path(tree, [10, 20, 30, 0, 0, 0, 0]) == [0, 1, 3]
    # callable on depth (labels), None stops
    labels = {0: 11, 1: 20, 2: None}
    assert accepted_length(tree, lambda row, depth: labels[depth]) == 2
    assert accepted_length(tree, lambda row, depth: 12) == 0
    with pytest.raises(ValueError, match="n\\+1"):
        accepted_path(tree, [1, 2, 3])


@pytest.mark.parametrize("budget", [0, -1, 1.5, True, "4"])
def test_budget_validation(budget):
    lp, tok = _example()
    with pytest.raises(ValueError, match="budget"):
        build_ddtree(lp, tok, budget)
    with pytest.raises(ValueError, match="budget"):
        build_ddtree_batched(lp[None], tok[None], budget)


def test_input_validation():
    lp, tok = _example()
    with pytest.raises(ValueError, match="sorted descending"):
        build_ddtree(lp.flip(-1), tok, 3)
    with pytest.raises(ValueError, match=r"\[D, k\]"):
        build_ddtree(lp, tok[:, :1], 3)
    with pytest.raises(ValueError, match="NaN"):
        build_ddtree(torch.full((2, 2), float("nan")), tok[:2], 3)
    assert build_ddtree(lp, tok, budget=1).parents.tolist() == [-1]


def _random_topk(seed: int, m: int, d: int, k: int, quantize: bool = False):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(m, d, 8, generator=g) * 2, -1)
    if quantize:  # make ties frequent, and some -inf
        lp = (lp * 2).round() / 2
        lp[torch.rand(lp.shape, generator=g) < 0.1] = float("-inf")
    lp, ids = lp.topk(k, dim=-1)
    return lp, ids


@pytest.mark.parametrize("quantize", [False, True])
def test_batched_equals_scalar(quantize):
    lp, ids = _random_topk(0, m=12, d=5, k=3, quantize=quantize)
    for budget in (1, 4, 9, 30, 400):
        bt = build_ddtree_batched(lp, ids, budget)
        for i in range(lp.shape[0]):
            ref = build_ddtree(lp[i], ids[i], budget)
            got = bt.tree(i)
            for field in ("parents", "depths", "token_ids", "ranks"):
                assert torch.equal(getattr(got, field), getattr(ref, field)), (budget, i, field)
            assert torch.equal(got.scores, ref.scores)


def test_tree_is_top_budget_prefix_closed_set():
    # brute force: every node of the full tree, scored; the DDTree holds the best b scores.
    lp, ids = _random_topk(1, m=6, d=3, k=3)
    for i in range(lp.shape[0]):
        all_scores = []
        for depth in range(1, 4):
            for ranks in itertools.product(range(3), repeat=depth):
                all_scores.append(sum(float(lp[i, j, r]) for j, r in enumerate(ranks)))
        all_scores.sort(reverse=True)
        prev = None
        for budget in range(1, 40):
            tree = build_ddtree(lp[i], ids[i], budget)
            n = min(budget, 39)
            assert tree.num_nodes == n
            assert sorted(tree.scores.tolist(), reverse=True) == pytest.approx(
                all_scores[:n], abs=1e-9
            )
            assert all(p < j for j, p in enumerate(tree.parents.tolist()))  # parents first
            if prev is not None:  # nested in the budget
                assert torch.equal(tree.parents[: prev.num_nodes], prev.parents)
            prev = tree


def test_batched_label_acceptance_matches_scalar_walk():
    lp, ids = _random_topk(2, m=20, d=4, k=2)
    g = torch.Generator().manual_seed(3)
    # labels mostly on the top-2 to make long acceptances common; column 0 is the root
    pick = torch.randint(0, 2, (20, 4), generator=g)
    labels = torch.cat([torch.full((20, 1), -100), ids.gather(-1, pick[..., None])[..., 0]], 1)
    labels[torch.rand(labels.shape, generator=g) < 0.1] = 7  # sometimes outside the top-k
    labels[3, 2] = -100  # invalid label mid-block stops acceptance
    for budget in (1, 3, 8, 30):
        bt = build_ddtree_batched(lp, ids, budget)
        got = batched_label_acceptance(bt, labels)
        for i in range(20):
            row = labels[i].tolist()

            def choice(r, depth, row=row):
                nxt = depth + 1
                return row[nxt] if nxt < len(row) and row[nxt] >= 0 else None

            assert int(got[i]) == accepted_length(build_ddtree(lp[i], ids[i], budget), choice)
    assert int(batched_label_acceptance(build_ddtree_batched(lp, ids, 30), labels)[3]) <= 1
