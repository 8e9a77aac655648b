"""Model-free drafts: n-gram prompt lookup (vLLM's rule) and suffix decoding, plus the tree
merge the hybrid methods use. Pure Python over token ids; no model.

- ``ngram_propose``: the longest suffix n-gram (n in [n_min, n_max]) found earlier in the
  sequence, and the tokens that followed it. ``rule="earliest"`` is vLLM's ``NgramProposer``
  (``prompt_lookup_min/max``, ``num_speculative_tokens``): the first occurrence, so inside a
  loop it still proposes a full draft; ``rule="latest"`` takes the most recent occurrence (the
  continuation is cut at the end of the sequence, short inside loops).
- ``SuffixIndex`` / ``suffix_draft``: SuffixDecoding (arXiv 2411.04975; ArcticInference ships
  the reference). Counts of every substring up to ``depth`` tokens of the indexed text form a
  suffix trie; the longest suffix of the current sequence found there (with a continuation
  and room below it for a full draft) roots a draft tree grown best-first by the empirical
  continuation probability ``count(child) / count(parent)`` (the parent's occurrences include
  the current one, which has no continuation yet: a pattern seen once before drafts at 1/2),
  kept while the path probability is at least ``min_prob``. The tree's score (Σ path probabilities) is its expected number of accepted
  tokens under those counts. One index holds the request (prompt + output so far), another the
  earlier outputs served (a global cache); the better-scoring draft is used.
- ``merge_trees``: two draft trees as one, nodes taken by decreasing path probability within a
  node budget (the hybrid's DDTree with the model-free draft as extra branches).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from dflash_lit.eval.ddtree import Tree

NGRAM_RULES = ("earliest", "latest")


def ngram_propose(tokens: Sequence[int], max_len: int, n_max: int = 3, n_min: int = 1,
                  rule: str = "earliest") -> list[int]:
    """Up to ``max_len`` tokens that followed an earlier occurrence of the longest suffix
    n-gram of ``tokens`` (n = n_max .. n_min); [] when nothing matches. ``rule`` picks the
    occurrence: ``earliest`` (vLLM) or ``latest``."""
    if rule not in NGRAM_RULES:
        raise ValueError(f"ngram rule={rule!r}: choose one of {list(NGRAM_RULES)}")
    if max_len <= 0:
        return []
    seq = list(tokens)
    t = len(seq)
    for n in range(min(n_max, t - 1), n_min - 1, -1):
        pattern = seq[t - n:]
        # start positions i < t - n (the suffix itself excluded)
        starts = range(t - n) if rule == "earliest" else range(t - n - 1, -1, -1)
        for i in starts:
            if seq[i:i + n] == pattern:
                return seq[i + n:i + n + max_len]
    return []


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixIndex:
    """Occurrence counts of every substring of at most ``depth`` tokens of the text fed to it
    (a suffix trie cut at ``depth``), updated in O(depth) per appended token. Separate
    sequences (``end_sequence``) never form substrings across their boundary."""

    def __init__(self, depth: int = 32) -> None:
        if depth < 2:
            raise ValueError(f"suffix depth={depth}: need >= 2")
        self.depth = depth
        self.root = _Node()
        self._open: list[tuple[_Node, int]] = []  # nodes of the suffixes ending at the last token
        self.length = 0  # tokens of the current sequence indexed so far

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the current sequence."""
        for t in tokens:
            nxt = []
            for node, d in [(self.root, 0), *self._open]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                if d + 1 < self.depth:
                    nxt.append((child, d + 1))
            self._open = nxt
            self.length += 1

    def end_sequence(self) -> None:
        """Start a new sequence (the next ``extend`` does not continue this one)."""
        self._open = []
        self.length = 0

    def match(self, tokens: Sequence[int], room: int = 1) -> tuple[_Node | None, int]:
        """(node, length) of the longest suffix of ``tokens`` that occurs in the index with a
        continuation and leaves ``room`` levels below it (length <= depth - room); (None, 0)
        if none does."""
        for m in range(min(self.depth - max(room, 1), len(tokens)), 0, -1):
            node = self.root
            for t in tokens[len(tokens) - m:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, m
        return None, 0


def _grow(node: _Node, budget: int, max_depth: int, min_prob: float) -> list[tuple[float, int, int, int]]:
    """Best-first nodes below ``node``: (path probability, parent index, depth, token), parents
    before children, in decreasing probability."""
    out: list[tuple[float, int, int, int]] = []
    heap: list[tuple[float, int, int, int, _Node]] = []
    tie = 0

    def push(parent_idx: int, parent: _Node, prob: float, depth: int) -> None:
        nonlocal tie
        for tok, child in parent.children.items():
            # occurrences of the parent that went on with this token, over all its
            # occurrences (the current one, and any at a sequence end, have no continuation)
            p = prob * child.count / parent.count
            if p >= min_prob:
                tie += 1
                heapq.heappush(heap, (-p, tie, parent_idx, depth, tok, child))

    push(-1, node, 1.0, 1)
    while heap and len(out) < budget:
        neg_p, _, parent_idx, depth, tok, child = heapq.heappop(heap)
        out.append((-neg_p, parent_idx, depth, tok))
        if depth < max_depth:
            push(len(out) - 1, child, -neg_p, depth + 1)
    return out


def _as_tree(nodes: list[tuple[float, int, int, int]]) -> Tree:
    """``Tree`` from (probability, parent, depth, token) rows; scores are log-probabilities."""
    if not nodes:
        e = torch.zeros(0, dtype=torch.long)
        return Tree(e, e.clone(), e.clone(), e.clone(), torch.zeros(0, dtype=torch.float64))
    p, parent, depth, tok = zip(*nodes)
    return Tree(
        parents=torch.tensor(parent, dtype=torch.long),
        depths=torch.tensor(depth, dtype=torch.long),
        token_ids=torch.tensor(tok, dtype=torch.long),
        ranks=torch.zeros(len(nodes), dtype=torch.long),
        scores=torch.tensor([math.log(max(x, 1e-300)) for x in p], dtype=torch.float64),
    )


def suffix_draft(indexes: Sequence[SuffixIndex], tokens: Sequence[int], budget: int,
                 max_depth: int, min_prob: float = 0.1) -> tuple[Tree, float]:
    """The best-scoring suffix draft tree over ``indexes`` for the sequence ``tokens`` (at most
    ``budget`` nodes, ``max_depth`` deep): (tree, score = Σ path probabilities, 0 if empty)."""
    best: list[tuple[float, int, int, int]] = []
    best_score = 0.0
    for index in indexes:
        node, _ = index.match(tokens, room=max_depth)
        if node is None:
            continue
        nodes = _grow(node, budget, max_depth, min_prob)
        score = sum(n[0] for n in nodes)
        if score > best_score:
            best, best_score = nodes, score
    return _as_tree(best), best_score


def tree_paths(tree: Tree) -> list[tuple[int, ...]]:
    """Each node's token path from the root, in node order."""
    parents, toks = tree.parents.tolist(), tree.token_ids.tolist()
    paths: list[tuple[int, ...]] = []
    for p, t in zip(parents, toks):
        paths.append((paths[p] if p >= 0 else ()) + (t,))
    return paths


def merge_trees(a: Tree, b: Tree, budget: int) -> Tree:
    """One tree of at most ``budget`` nodes holding the most probable nodes of ``a`` and ``b``
    (a path in both counts once, with the larger probability). Each input lists parents before
    children with non-increasing path probability along every path, so taking nodes by
    decreasing probability keeps every taken node's ancestors."""
    cand: dict[tuple[int, ...], float] = {}
    for tree in (a, b):
        for path, s in zip(tree_paths(tree), tree.scores.tolist()):
            cand[path] = max(cand.get(path, -math.inf), s)
    # ties: shorter paths first, so a parent always precedes its equally probable child
    order = sorted(cand, key=lambda path: (-cand[path], len(path)))
    index: dict[tuple[int, ...], int] = {}
    rows: list[tuple[float, int, int, int]] = []
    for path in order:
        if len(rows) >= budget:
            break
        parent = index.get(path[:-1], -1) if len(path) > 1 else -1
        if len(path) > 1 and path[:-1] not in index:
            continue  # its parent fell outside the budget
        index[path] = len(rows)
        rows.append((math.exp(cand[path]), parent, len(path), path[-1]))
    return _as_tree(rows)
