"""The cost rule (``trim_drafts``): the prefix it keeps is the hand-computed best, a prefix of a
best-first tree is a tree, and decoding with it stays lossless for every method it touches."""

from __future__ import annotations

import pytest
import torch

from dflash_lit import DFlashConfig, DFlashDrafter
from dflash_lit.eval.ddtree import build_ddtree
from dflash_lit.eval.model_free import SuffixIndex
from dflash_lit.eval.report import EvalSettings, run_evaluation
from dflash_lit.eval.speculative import (
    chain_generate,
    first_mismatch,
    hybrid_generate,
    suffix_tree_generate,
    target_greedy,
    tree_generate,
)
from dflash_lit.eval.verify_cost import Trimmer, VerifyCost, best_prefix, chain_path_probs, prefix
from dflash_lit.tiny.random_targets import tiny_qwen3

V, D, L = 96, 32, 4


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(vocab_size=V, hidden_size=D, num_layers=L, head_dim=8, intermediate_size=64,
                      seed=0)


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(1)
    cfg = DFlashConfig(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=48, num_hidden_layers=1, block_size=6, mask_token_id=3,
                       num_target_layers=L, target_layer_ids=[0, 2, 3], vocab_size=V)
    return DFlashDrafter(cfg).eval()


def test_cost_table_interpolates_and_refuses_bad_tables():
    c = VerifyCost([1, 2, 4], [1.0, 1.5, 2.5])
    assert [c(q) for q in (0, 1, 2, 3, 4, 6)] == [1.0, 1.0, 1.5, 2.0, 2.5, 3.5]
    with pytest.raises(ValueError, match="ascending"):
        VerifyCost([2, 1], [1.0, 1.0])
    with pytest.raises(ValueError, match="ascending"):
        VerifyCost([1, 2], [1.0])


def test_best_prefix_is_the_hand_computed_rate_maximum():
    # T(1)=1, T(2)=1.1, T(3)=3: n=0 -> 1/1, n=1 -> 1.9/1.1 = 1.73, n=2 -> 2.0/3 = 0.67
    steep = VerifyCost([1, 2, 3], [1.0, 1.1, 3.0])
    assert best_prefix([0.9, 0.1], steep, draft_s=0.0, calib=1.0) == 1
    # a flat cost (a GPU) keeps every node with any probability
    flat = VerifyCost([1, 3], [1.0, 1.0])
    assert best_prefix([0.9, 0.1], flat, 0.0, 1.0) == 2
    # a proposer whose nodes are never accepted (calibration 0) drafts nothing
    assert best_prefix([0.9, 0.1], flat, 0.0, 0.0) == 0
    # the proposer's own time counts: past draft_s = 35 the third token's extra 1.9 s is
    # worth its 0.1 expected tokens (2.0 / 53 > 1.9 / 51.1 at draft_s = 50)
    assert best_prefix([0.9, 0.1], steep, draft_s=50.0, calib=1.0) == 2
    assert chain_path_probs(torch.tensor([[0.0, 0.0], [0.0, 100.0]])) == pytest.approx([0.5, 0.5])


def test_a_prefix_of_a_ddtree_is_a_tree():
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(5, 8, generator=g), -1).topk(4, dim=-1)
    tree = build_ddtree(lp.values, lp.indices, 12)
    for n in range(tree.num_nodes + 1):
        t = prefix(tree, n)
        assert t.num_nodes == n
        assert all(-1 <= int(p) < i for i, p in enumerate(t.parents))
        assert torch.equal(t.token_ids, tree.token_ids[:n])


def test_trimmed_decoding_is_lossless_and_the_rule_bites(target, drafter):
    # verify cost rising 1.25 % a token: this random drafter's trees are cut to 0-3 nodes
    cost = VerifyCost([1, 17], [1.0, 1.2])
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, V, (n,), generator=g).tolist() for n in (5, 11, 17)]
    index = SuffixIndex(8)
    runs = {
        "chain": lambda p, t: chain_generate(target, drafter, p, 23, trimmer=t),
        "tree": lambda p, t: tree_generate(target, drafter, p, 23, budget=8, trimmer=t),
        "suffix_tree": lambda p, t: suffix_tree_generate(target, p, 23, block_size=6, budget=6,
                                               global_index=index, depth=8, trimmer=t),
        "hybrid": lambda p, t: hybrid_generate(target, drafter, p, 23, budget=8, depth=8,
                                               global_index=index, trimmer=t),
        "merged": lambda p, t: hybrid_generate(target, drafter, p, 23, budget=8, depth=8,
                                               global_index=index, merge=True, trimmer=t),
    }
    for name, run in runs.items():
        trimmer = Trimmer(cost)
        for p in prompts:
            ref = target_greedy(target, p, 23).tokens
            r = run(p, trimmer)
            assert r.tokens == ref, (name, first_mismatch(r.tokens, ref))
            assert sum(r.acceptance_lengths) + 1 == len(r.tokens)
            index.extend(ref)
            index.end_sequence()
        if name in ("tree", "merged"):  # 8-node trees, cut per step to a prefix that varies
            assert min(trimmer.kept) < 8 and len(set(trimmer.kept)) > 1, (name, trimmer.kept)
            assert trimmer.predicted > 1.0  # the kept nodes' predictions reached the calibration


def test_evaluation_measures_the_cost_once_and_stays_lossless(target, drafter):
    g = torch.Generator().manual_seed(3)
    prompts = [(f"p{i}", torch.randint(4, V, (n,), generator=g).tolist()) for i, n in
               enumerate((6, 12))]
    s = EvalSettings(methods=["chain", "tree", "merged", "ngram"], budgets=[6],
                     max_new_tokens=16, trim_drafts=True, warmup=False)
    rep = run_evaluation(target, drafter, prompts, s, progress=False)
    assert rep["lossless"]
    vc = rep["verify_cost"]
    assert vc["sizes"][0] == 1 and len(vc["sizes"]) == len(vc["seconds"])
    assert all(t > 0 for t in vc["seconds"])
