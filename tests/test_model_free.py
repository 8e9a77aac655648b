"""Model-free drafts on hand-made sequences: vLLM's n-gram rule, the suffix index and its
draft trees, and the tree merge of the hybrid."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_lit.eval.ddtree import Tree, accepted_path, tree_attention_mask
from dflash_lit.eval.model_free import (
    SuffixIndex,
    merge_trees,
    ngram_propose,
    suffix_draft,
    tree_paths,
)


def test_ngram_earliest_drafts_a_full_block_inside_a_loop():
    loop = [1, 2, 3] * 3 + [1, 2]  # ... 3 1 2: the trigram "3 1 2" occurred at 2 and 5
    assert ngram_propose(loop, 6) == [3, 1, 2, 3, 1, 2]  # vLLM: from the earliest occurrence
    assert ngram_propose(loop, 6, rule="latest") == [3, 1, 2]  # cut at the end of the sequence


def test_ngram_prefers_the_longest_match_then_shorter_ones():
    seq = [7, 8, 9, 4, 8, 9, 5, 7, 8, 9]
    assert ngram_propose(seq, 2, n_max=3) == [4, 8]  # "7 8 9" at 0 beats "8 9" at 4
    assert ngram_propose(seq, 2, n_max=2) == [4, 8]  # "8 9": earliest at 1
    assert ngram_propose(seq, 2, n_max=2, rule="latest") == [5, 7]  # "8 9" latest at 4
    assert ngram_propose([1, 2, 3, 4], 3, n_max=3, n_min=2) == []  # nothing of length >= 2
    with pytest.raises(ValueError, match="rule='first'"):
        ngram_propose(seq, 2, rule="first")


def test_suffix_index_counts_substrings_and_matches_the_longest_suffix_with_a_continuation():
    idx = SuffixIndex(depth=4)
    seq = [1, 2, 3, 1, 2, 4, 1, 2]
    idx.extend(seq)
    assert idx.root.children[1].count == 3 and idx.root.children[1].children[2].count == 3
    assert idx.root.children[1].children[2].children[3].count == 1
    node, m = idx.match(seq)  # "4 1 2" and "2 4 1 2"... occur only at the end: "1 2" it is
    assert m == 2 and {t: c.count for t, c in node.children.items()} == {3: 1, 4: 1}
    idx.end_sequence()
    idx.extend([9, 1])  # a new sequence: no substring crosses into it from the last one
    assert 9 not in idx.root.children[2].children
    assert idx.match([5, 6]) == (None, 0)


def test_suffix_draft_is_best_first_by_empirical_probability():
    idx = SuffixIndex(depth=6)
    seq = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]  # "1 2" 4 times: then 3 twice, 4 once, now open
    idx.extend(seq)
    tree, score = suffix_draft([idx], seq, budget=3, max_depth=4, min_prob=0.1)
    paths = tree_paths(tree)
    # longest matched suffix with a continuation: "2 4 1 2" occurs only at the end; "1 2"
    # went on with 3 in 2 of its 4 occurrences
    assert paths[0] == (3,)
    assert math.isclose(math.exp(float(tree.scores[0])), 2 / 4)
    assert len(paths) == 3 and all(p[:-1] in paths[:i] or len(p) == 1 for i, p in enumerate(paths))
    assert math.isclose(score, sum(math.exp(s) for s in tree.scores.tolist()))
    tree_attention_mask(tree)  # a valid tree: parents precede children
    empty, s0 = suffix_draft([idx], [42], budget=3, max_depth=4)
    assert empty.num_nodes == 0 and s0 == 0.0


def test_suffix_draft_takes_the_better_of_the_request_and_the_global_index():
    local, glob = SuffixIndex(6), SuffixIndex(6)
    glob.extend([5, 6, 7, 8, 9, 10])  # an earlier output: after "5 6" always "7 8 9 10"
    glob.end_sequence()
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    local.extend(tokens)  # the request alone: after "5 6" once "1", once "2"
    tree, score = suffix_draft([local, glob], tokens, budget=8, max_depth=4)
    assert tree_paths(tree) == [(7,), (7, 8), (7, 8, 9), (7, 8, 9, 10)] and score == 4.0
    alone, s_local = suffix_draft([local], tokens, budget=8, max_depth=4)
    # "5 6" 3 times in the request: 1 once, 2 once, and the open end: two branches at 1/3
    assert alone.num_nodes == 7 and math.isclose(s_local, 7 / 3)


def _tree(paths_scores):
    index, rows = {}, []
    for path, p in paths_scores:
        index[path] = len(rows)
        rows.append((index.get(path[:-1], -1), len(path), path[-1], math.log(p)))
    parents, depths, toks, scores = zip(*rows)
    t = torch.tensor
    return Tree(t(parents), t(depths), t(toks), torch.zeros(len(rows), dtype=torch.long),
                t(scores, dtype=torch.float64))


def test_merge_trees_keeps_the_most_probable_nodes_once_within_the_budget():
    a = _tree([((1,), 0.6), ((2,), 0.3), ((1, 5), 0.4)])
    b = _tree([((1,), 0.9), ((1, 5), 0.8), ((1, 5, 6), 0.7), ((3,), 0.05)])
    m = merge_trees(a, b, budget=4)
    assert tree_paths(m) == [(1,), (1, 5), (1, 5, 6), (2,)]
    # the merged tree verifies like any draft tree: the target chooses 1, then 5, then 6
    assert accepted_path(m, [1, 5, 6, 0, 0]) == [0, 1, 2]
    assert merge_trees(a, b, budget=1).num_nodes == 1
