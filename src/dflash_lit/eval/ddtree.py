"""DDTree: best-first draft trees over a block drafter's per-depth top-k (pure tensor code).

Shared by the offline training metric (``ddtree_b``) and the speculative-decoding evaluator.

Construction (DDTree): depth d (1..D) uses row d-1 of the per-depth top-k log-probs
``log q`` (sorted descending). A node's score is its path score Σ log q. Start from the root
(depth 0, the anchor / bonus token); repeatedly pop the best frontier node, add it to the
tree, then push its next sibling (same parent, same depth, next rank) and its first child
(next depth, rank 0). Stop after ``budget`` nodes (root excluded) or when nothing is left.
Because log q <= 0 and each row is sorted, a node never scores above its parent or its
previous sibling, so the pop order is the global descending order of path scores and the
tree with budget b is the best prefix-closed set of b nodes; trees are nested in b.

Ties: equal scores pop in push order (the sibling is pushed before the child). Scores are
float64 and log-probs are clamped at ``LOG_PROB_FLOOR`` so -inf (masked vocab) stays
orderable; the scalar and the batched builders do the same float64 additions, so they build
identical trees.

Numbering: nodes are 0..n-1 in pop order (a parent always precedes its children);
``parents[i]`` is the parent's node index, -1 for the root. In the attention mask and in
position ids the root is row 0 and node i is row i+1.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

LOG_PROB_FLOOR = -1e30  # stands in for -inf: finite, so sums stay orderable in float64


@dataclass
class Tree:
    """A draft tree of n nodes (root excluded), nodes in pop order.

    Attributes:
        parents: [n] int64, parent node index, -1 for a child of the root.
        depths: [n] int64, 1..D (the root has depth 0).
        token_ids: [n] int64, the drafted token of each node.
        ranks: [n] int64, rank of the token in its depth's top-k (0 = best).
        scores: [n] float64, path score Σ log q from the root.
    """

    parents: Tensor
    depths: Tensor
    token_ids: Tensor
    ranks: Tensor
    scores: Tensor

    @property
    def num_nodes(self) -> int:
        """Number of nodes, root excluded."""
        return int(self.parents.numel())


@dataclass
class BatchedTree:
    """M independent trees padded to ``budget`` nodes; entries past ``num_nodes`` are padding.

    Same fields as ``Tree`` with a leading M dimension; padding has parent -2, depth 0,
    token -1, rank -1, score -inf. ``node_mask`` [M, budget] marks real nodes.
    """

    parents: Tensor
    depths: Tensor
    token_ids: Tensor
    ranks: Tensor
    scores: Tensor
    num_nodes: Tensor  # [M] int64

    @property
    def node_mask(self) -> Tensor:
        """[M, budget] bool: True for real nodes."""
        return self.depths > 0

    def tree(self, i: int) -> Tree:
        """The i-th tree, unpadded."""
        n = int(self.num_nodes[i])
        return Tree(
            self.parents[i, :n],
            self.depths[i, :n],
            self.token_ids[i, :n],
            self.ranks[i, :n],
            self.scores[i, :n],
        )


# --------------------------------------------------------------------------- validation
def _check_budget(budget: int) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(
            f"DDTree budget={budget!r}: the node budget (root excluded) must be an int >= 1"
        )


def _prepare(log_probs_topk: Tensor, token_ids_topk: Tensor, batched: bool) -> Tensor:
    want = 3 if batched else 2
    shape = "[M, D, k]" if batched else "[D, k]"
    if log_probs_topk.dim() != want or token_ids_topk.shape != log_probs_topk.shape:
        raise ValueError(
            f"DDTree: log_probs_topk {tuple(log_probs_topk.shape)} and token_ids_topk "
            f"{tuple(token_ids_topk.shape)} must both be {shape}"
        )
    if log_probs_topk.shape[-1] < 1 or log_probs_topk.shape[-2] < 1:
        raise ValueError(
            f"DDTree: need D >= 1 depths and k >= 1 candidates, got {shape}="
            f"{tuple(log_probs_topk.shape)}"
        )
    lp = log_probs_topk.detach().to(torch.float64)
    if torch.isnan(lp).any():
        raise ValueError("DDTree: log_probs_topk contains NaN")
    lp = lp.clamp(min=LOG_PROB_FLOOR)
    if (lp[..., 1:] > lp[..., :-1]).any():
        raise ValueError(
            "DDTree: log_probs_topk must be sorted descending along the last dim "
            "(use torch.topk(..., sorted=True))"
        )
    return lp


# --------------------------------------------------------------------------- builders
def build_ddtree(log_probs_topk: Tensor, token_ids_topk: Tensor, budget: int) -> Tree:
    """Best-first DDTree from per-depth top-k log-probs [D, k] (sorted desc) and their ids.

    Returns up to ``budget`` nodes (fewer only if all Σ_d k^d nodes fit). See the module
    docstring for the exact order and tie-break.
    """
    _check_budget(budget)
    lp_t = _prepare(log_probs_topk, token_ids_topk, batched=False)
    depth_max, k = lp_t.shape
    lp = lp_t.tolist()
    tok = token_ids_topk.tolist()
    # heap entry: (-score, push counter, depth, rank, parent node, parent score)
    counter = 0
    heap: list[tuple[float, int, int, int, int, float]] = [(-(0.0 + lp[0][0]), 0, 1, 0, -1, 0.0)]
    parents: list[int] = []
    depths: list[int] = []
    ranks: list[int] = []
    scores: list[float] = []
    while heap and len(parents) < budget:
        neg, _, d, r, parent, pscore = heapq.heappop(heap)
        node, score = len(parents), -neg
        parents.append(parent)
        depths.append(d)
        ranks.append(r)
        scores.append(score)
        if r + 1 < k:  # next sibling: same parent, next rank
            counter += 1
            heapq.heappush(heap, (-(pscore + lp[d - 1][r + 1]), counter, d, r + 1, parent, pscore))
        if d < depth_max:  # first child: next depth, rank 0
            counter += 1
            heapq.heappush(heap, (-(score + lp[d][0]), counter, d + 1, 0, node, score))
    tokens = [tok[d - 1][r] for d, r in zip(depths, ranks)]
    long = dict(dtype=torch.long)
    return Tree(
        parents=torch.tensor(parents, **long),
        depths=torch.tensor(depths, **long),
        token_ids=torch.tensor(tokens, **long),
        ranks=torch.tensor(ranks, **long),
        scores=torch.tensor(scores, dtype=torch.float64),
    )


def build_ddtree_batched(
    log_probs_topk: Tensor, token_ids_topk: Tensor, budget: int
) -> BatchedTree:
    """``build_ddtree`` for M independent trees at once ([M, D, k] inputs), on their device.

    Runs ``budget`` vectorised steps (no Python loop over M or V). The frontier is an
    append-only array: step t writes the sibling to slot 2t+1 and the child to 2t+2, so
    "first maximal slot" is exactly the scalar builder's push-order tie-break.
    """
    _check_budget(budget)
    lp = _prepare(log_probs_topk, token_ids_topk, batched=True)
    m, depth_max, k = lp.shape
    dev = lp.device
    cap = 2 * budget + 1
    rows = torch.arange(m, device=dev)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=dev)

    f_score = torch.full((m, cap), float("-inf"), dtype=torch.float64, device=dev)
    f_pscore = torch.zeros((m, cap), dtype=torch.float64, device=dev)
    f_depth = torch.zeros((m, cap), dtype=torch.long, device=dev)
    f_rank = torch.zeros((m, cap), dtype=torch.long, device=dev)
    f_parent = torch.full((m, cap), -1, dtype=torch.long, device=dev)
    f_alive = torch.zeros((m, cap), dtype=torch.bool, device=dev)
    f_score[:, 0] = 0.0 + lp[:, 0, 0]
    f_depth[:, 0] = 1
    f_alive[:, 0] = True

    parents = torch.full((m, budget), -2, dtype=torch.long, device=dev)
    depths = torch.zeros((m, budget), dtype=torch.long, device=dev)
    ranks = torch.full((m, budget), -1, dtype=torch.long, device=dev)
    tokens = torch.full((m, budget), -1, dtype=torch.long, device=dev)
    scores = torch.full((m, budget), float("-inf"), dtype=torch.float64, device=dev)
    tok_ids = token_ids_topk.to(dev).long()

    for t in range(budget):
        sel = torch.where(f_alive, f_score, neg_inf).argmax(-1)  # first max = earliest push
        ok = f_alive[rows, sel]
        d, r = f_depth[rows, sel], f_rank[rows, sel]
        score, pscore, parent = f_score[rows, sel], f_pscore[rows, sel], f_parent[rows, sel]
        f_alive[rows, sel] = False
        d_idx = (d - 1).clamp(min=0)
        parents[:, t] = torch.where(ok, parent, parents[:, t])
        depths[:, t] = torch.where(ok, d, depths[:, t])
        ranks[:, t] = torch.where(ok, r, ranks[:, t])
        scores[:, t] = torch.where(ok, score, scores[:, t])
        tokens[:, t] = torch.where(ok, tok_ids[rows, d_idx, r.clamp(max=k - 1)], tokens[:, t])
        # next sibling -> slot 2t+1
        has_sib = ok & (r + 1 < k)
        s = 2 * t + 1
        f_alive[:, s] = has_sib
        f_score[:, s] = pscore + lp[rows, d_idx, (r + 1).clamp(max=k - 1)]
        f_pscore[:, s] = pscore
        f_depth[:, s] = d
        f_rank[:, s] = r + 1
        f_parent[:, s] = parent
        # first child -> slot 2t+2
        has_child = ok & (d < depth_max)
        c = 2 * t + 2
        f_alive[:, c] = has_child
        f_score[:, c] = score + lp[rows, d.clamp(max=depth_max - 1), 0]
        f_pscore[:, c] = score
        f_depth[:, c] = d + 1
        f_rank[:, c] = 0
        f_parent[:, c] = t
    return BatchedTree(parents, depths, tokens, ranks, scores, (depths > 0).sum(-1))


# --------------------------------------------------------------------------- verification helpers
def tree_attention_mask(tree: Tree) -> Tensor:
    """[n+1, n+1] bool ancestor-only mask (incl. self); row/col 0 is the root, node i is i+1.

    ``mask[i, j]`` is True iff j is i itself or one of its ancestors (the root is an
    ancestor of every node) — what one verification pass of the target may attend to.
    """
    n = tree.num_nodes
    mask = torch.zeros((n + 1, n + 1), dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(tree.parents.tolist()):  # parents precede children
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return mask


def tree_position_ids(tree: Tree, start: int) -> Tensor:
    """[n+1] positions for one verification pass: root at ``start``, node at start + depth."""
    return start + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths.cpu()])


TargetChoice = Sequence[int] | Tensor | Callable[[int, int], "int | None"]


def accepted_path(tree: Tree, target_choice: TargetChoice) -> list[int]:
    """Nodes accepted by greedy verification, root to leaf, as node indices.

    ``target_choice`` is either the target's greedy next token at every mask row ([n+1]:
    row 0 = root, row i+1 = node i, from one pass with ``tree_attention_mask``), or a
    callable ``fn(row, depth) -> token | None`` (None = stop, e.g. no valid label there).
    From the root, repeatedly move to the child whose token equals the target's choice at
    the current row (siblings hold distinct top-k tokens, so there is at most one).
    """
    if callable(target_choice):
        choice = target_choice
    else:
        seq = target_choice.tolist() if isinstance(target_choice, Tensor) else list(target_choice)
        if len(seq) != tree.num_nodes + 1:
            raise ValueError(
                f"accepted_path: target_choice has {len(seq)} entries, expected n+1 = "
                f"{tree.num_nodes + 1} (root first, then one per node)"
            )

        def choice(row: int, depth: int) -> int | None:
            return int(seq[row])

    children: dict[int, dict[int, int]] = {}
    for i, (p, tok) in enumerate(zip(tree.parents.tolist(), tree.token_ids.tolist())):
        children.setdefault(p, {})[tok] = i
    path: list[int] = []
    node, depth = -1, 0
    while True:
        want = choice(node + 1, depth)
        if want is None or int(want) not in children.get(node, {}):
            return path
        node = children[node][int(want)]
        depth += 1
        path.append(node)


def accepted_length(tree: Tree, target_choice: TargetChoice) -> int:
    """Number of accepted draft nodes (root excluded); τ = accepted_length + 1 (bonus)."""
    return len(accepted_path(tree, target_choice))


def batched_label_acceptance(tree: BatchedTree, labels: Tensor) -> Tensor:
    """[M] accepted depth of each tree when the target's choice is ``labels`` [M, D+1].

    ``labels[:, d]`` is the token the target wants at depth d (column 0, the root, is not
    used); -100 (or any negative id) stops acceptance there. A node is on the label path iff
    its parent is (or is the root) and its token equals the label at its depth.
    """
    m, budget = tree.depths.shape
    if labels.dim() != 2 or labels.shape[0] != m:
        raise ValueError(
            f"batched_label_acceptance: labels {tuple(labels.shape)} must be [M={m}, D+1]"
        )
    rows = torch.arange(m, device=tree.depths.device)
    labels = labels.to(tree.depths.device)
    d = tree.depths.clamp(max=labels.shape[1] - 1)
    want = labels[rows[:, None], d]  # [M, budget]
    match = tree.node_mask & (tree.token_ids == want) & (want >= 0)
    on_path = torch.zeros((m, budget), dtype=torch.bool, device=labels.device)
    for t in range(budget):
        p = tree.parents[:, t]
        parent_ok = (p == -1) | on_path[rows, p.clamp(min=0)]
        on_path[:, t] = match[:, t] & parent_ok
    return torch.where(on_path, tree.depths, torch.zeros_like(tree.depths)).amax(-1)
