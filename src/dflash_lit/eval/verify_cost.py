"""Draft size chosen per step by this machine's verification cost (``trim_drafts=true``).

On a GPU verifying 16 tokens costs about what verifying one does, so a draft should be as big
as the budget allows. On a CPU it does not: measured on 2 cores for SmolLM2-135M
(``bench/step_cost.py``), a 16-token verify forward costs ~2x a 1-token one, so a step whose
draft the target is likely to reject is cheaper as plain decoding. Every step's draft lists its
nodes best first (DDTree and suffix trees pop by path probability; a chain is its own order),
so any prefix of it is a valid draft. The rule keeps the prefix of n nodes that maximises
expected committed tokens per second,

    (1 + c · Σ_{i<n} p_i) / (T(n + 1) + D),

with p_i the path probabilities the proposer gave its nodes (Σ p = the expected accepted
length when they are calibrated), c the proposer's calibration in this request so far (accepted
/ predicted, prior 1), T(q) the measured seconds of a q-token verify forward (interpolated) and
D the proposer's own seconds this step. Losslessness does not depend on any of it: the target
verifies whatever is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflash_lit.eval.ddtree import Tree
from dflash_lit.eval.target_runner import cache_length, drop_last

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # verified tokens timed by ``measure``


@dataclass
class VerifyCost:
    """Seconds of one target forward verifying q tokens, measured at ``sizes`` (ascending)."""

    sizes: list[int]
    seconds: list[float]

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds) or self.sizes != sorted(set(self.sizes)):
            raise ValueError("VerifyCost: sizes must be ascending, unique, one time per size")

    def __call__(self, q: int) -> float:
        """Piecewise-linear in q between measured sizes; flat below the first, linear past the
        last (its last segment's slope)."""
        s, t = self.sizes, self.seconds
        if q <= s[0] or len(s) == 1:
            return t[0]
        for i in range(1, len(s)):
            if q <= s[i]:
                return t[i - 1] + (t[i] - t[i - 1]) * (q - s[i - 1]) / (s[i] - s[i - 1])
        return t[-1] + (t[-1] - t[-2]) * (q - s[-1]) / (s[-1] - s[-2])

    def to_dict(self) -> dict[str, list]:
        return {"sizes": list(self.sizes), "seconds": [round(x, 6) for x in self.seconds]}


def measure(runner, prompt: list[int], sizes=DEFAULT_SIZES, repeats: int = 3) -> VerifyCost:
    """Time ``runner``'s verify forward of q tokens on top of ``prompt``'s cache (median of
    ``repeats``, after one warm-up), then roll the cache back."""
    pre = runner.forward(prompt, torch.arange(len(prompt)))
    cache, n = pre.cache, len(prompt)
    out = []
    for q in sizes:
        ids = [prompt[i % n] for i in range(q)]
        times = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            res = runner.forward(ids, torch.arange(n, n + q), cache=cache)
            dt = time.perf_counter() - t0
            drop_last(res.cache, cache_length(res.cache) - n)
            if r:
                times.append(dt)
        out.append(sorted(times)[len(times) // 2])
    return VerifyCost(list(sizes), out)


def best_prefix(path_probs: list[float], cost: VerifyCost, draft_s: float, calib: float) -> int:
    """The number of leading nodes (0..len) maximising (1 + calib·Σp) / (T(n+1) + draft_s)."""
    best_n, best_rate, expected = 0, 1.0 / (cost(1) + draft_s), 1.0
    for n, p in enumerate(path_probs, start=1):
        expected += calib * p
        rate = expected / (cost(n + 1) + draft_s)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def prefix(tree: Tree, n: int) -> Tree:
    """The first ``n`` nodes of ``tree`` (parents precede children, so still a tree)."""
    return Tree(tree.parents[:n], tree.depths[:n], tree.token_ids[:n], tree.ranks[:n],
                tree.scores[:n])


def chain_path_probs(logits: Tensor) -> list[float]:
    """Path probabilities of a chain of per-slot argmaxes: Π_{j<=k} max softmax of slot j."""
    p = torch.softmax(logits.float(), dim=-1).amax(-1)
    return torch.cumprod(p, 0).tolist()


@dataclass
class Trimmer:
    """Per-request state of the rule: the proposer's calibration (accepted / predicted nodes
    over the steps it drafted, prior 1 / 1)."""

    cost: VerifyCost
    accepted: float = 1.0
    predicted: float = 1.0
    kept: list[int] = field(default_factory=list)  # nodes kept per step (for reports/tests)

    @property
    def calib(self) -> float:
        return self.accepted / self.predicted

    def choose(self, path_probs: list[float], draft_s: float) -> int:
        n = best_prefix(path_probs, self.cost, draft_s, self.calib)
        self.kept.append(n)
        return n

    def trim(self, tree: Tree, draft_s: float) -> tuple[Tree, float]:
        """(the best prefix of ``tree``, its predicted Σp) for this step."""
        probs = tree.scores.exp().tolist()
        n = self.choose(probs, draft_s)
        return prefix(tree, n), float(sum(probs[:n]))

    def record(self, accepted: int, predicted: float) -> None:
        self.accepted += accepted
        self.predicted += predicted
