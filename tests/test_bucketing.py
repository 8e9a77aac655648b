"""BucketBatchSampler: coverage per epoch across ranks, budget, determinism, resume, efficiency."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_lit.data.bucketing import (
    BucketBatchSampler,
    padding_efficiency,
    quantile_boundaries,
    random_batches,
)


def _lengths(n: int = 500, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(5, 300, n)


def _lognormal(n: int = 4000, seed: int = 0) -> np.ndarray:
    # long-tailed like regenerated completions: median ~2.8k, capped at 8k
    raw = np.random.default_rng(seed).lognormal(np.log(2800), 0.6, n)
    return np.clip(np.round(raw), 64, 8192).astype(np.int64)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_sequence_once_per_epoch_across_ranks(world: int) -> None:
    lengths = _lengths(503)
    samplers = [
        BucketBatchSampler(lengths, 1024, seed=3, rank=r, world_size=world) for r in range(world)
    ]
    for epoch in (0, 1, 5):
        per_rank = [s.batches_for_epoch(epoch) for s in samplers]
        counts = {len(b) for b in per_rank}
        assert counts == {len(samplers[0])}, "every rank must get the same number of batches"
        seen = [i for batches in per_rank for b in batches for i in b]
        assert sorted(seen) == list(range(len(lengths)))  # union = all, no duplicates = disjoint
        for s in samplers:
            assert s.num_repeated == 0
    # iterating yields exactly batches_for_epoch
    assert list(samplers[-1]) == samplers[-1].batches_for_epoch(0)


def test_split_makes_rank_counts_equal_without_repeats() -> None:
    lengths = np.full(10, 100)  # budget 300 -> 3 per batch -> 4 batches: 3,3,3,1
    s1 = BucketBatchSampler(lengths, 300, world_size=1)
    assert sorted(len(b) for b in s1.batches_for_epoch(0)) == [1, 3, 3, 3]
    s3 = [BucketBatchSampler(lengths, 300, rank=r, world_size=3) for r in range(3)]
    # 4 batches -> 6 (two largest split: 3 -> 2+1 twice), 2 per rank
    sizes = sorted(len(b) for b in s3[0].global_batches_for_epoch(0))
    assert sizes == [1, 1, 1, 2, 2, 3]
    assert [len(s) for s in s3] == [2, 2, 2]


def test_repeat_fallback_when_nothing_can_be_split() -> None:
    s = [BucketBatchSampler([10, 10, 10], 10, rank=r, world_size=2) for r in range(2)]
    assert [len(x) for x in s] == [2, 2]
    assert s[0].num_repeated == 1
    allb = s[0].global_batches_for_epoch(0)
    assert len(allb) == 4 and sorted(i for b in allb[:3] for i in b) == [0, 1, 2]


def test_batches_respect_token_budget_and_oversize_gets_own_batch() -> None:
    lengths = np.concatenate([_lengths(400), [1500, 2000]])
    budget = 1024
    s = BucketBatchSampler(lengths, budget, num_buckets=8)
    for b in s.batches_for_epoch(0):
        cost = len(b) * int(lengths[b].max())
        if lengths[b].max() > budget:
            assert len(b) == 1
        else:
            assert cost <= budget
    singles = [b for b in s.batches_for_epoch(0) if lengths[b].max() > budget]
    assert sorted(singles) == [[400], [401]]


def test_max_length_over_budget_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"max_length=4096 exceeds token_budget=2048"):
        BucketBatchSampler([10, 20], 2048, max_length=4096)


def test_batches_stay_in_their_bucket() -> None:
    lengths = _lengths(300)
    bnd = [50, 120, 200]
    s = BucketBatchSampler(lengths, 2048, boundaries=bnd)
    for b in s.batches_for_epoch(2):
        buckets = set(np.searchsorted(bnd, lengths[b], side="left").tolist())
        assert len(buckets) == 1


def test_quantile_boundaries_hand_computed() -> None:
    # quantiles of 1..100 at .25/.5/.75 are 25.75, 50.5, 75.25 -> ceil
    assert quantile_boundaries(np.arange(1, 101), 4) == [26, 51, 76]
    assert quantile_boundaries(np.full(10, 7), 4) == [7]  # duplicates collapse
    assert quantile_boundaries(np.arange(1, 101), 1) == []


def test_orders_differ_per_epoch_and_repeat_per_seed() -> None:
    lengths = _lengths()
    a = BucketBatchSampler(lengths, 1024, seed=1)
    b = BucketBatchSampler(lengths, 1024, seed=1)
    c = BucketBatchSampler(lengths, 1024, seed=2)
    assert a.batches_for_epoch(0) == b.batches_for_epoch(0)
    assert a.batches_for_epoch(0) != a.batches_for_epoch(1)
    assert a.batches_for_epoch(0) != c.batches_for_epoch(0)
    assert len({len(a.batches_for_epoch(e)) for e in range(5)}) == 1  # constant len per epoch


def test_no_torch_randomness() -> None:
    lengths = _lengths()
    state = torch.get_rng_state()
    torch.manual_seed(123)
    x = BucketBatchSampler(lengths, 1024, seed=4).batches_for_epoch(3)
    torch.manual_seed(999)
    y = BucketBatchSampler(lengths, 1024, seed=4).batches_for_epoch(3)
    assert x == y
    torch.set_rng_state(state)


def test_iteration_advances_epochs_and_set_epoch() -> None:
    s = BucketBatchSampler(_lengths(), 1024, seed=0)
    assert list(s) == s.batches_for_epoch(0)
    assert s.state_dict()["batches_consumed"] == len(s)
    assert list(s) == s.batches_for_epoch(1)  # an exhausted epoch is not replayed empty
    s.set_epoch(1)  # same epoch: keeps the position (fully consumed)
    assert s.state_dict() == {
        "epoch": 1,
        "batches_consumed": len(s),
        "world_size": 1,
        "num_batches": len(s),
    }
    s.set_epoch(7)
    assert s.state_dict()["batches_consumed"] == 0
    assert next(iter(s)) == s.batches_for_epoch(7)[0]


@pytest.mark.parametrize("consumed", [0, 1, 17, "all"])
def test_state_dict_resumes_exactly(consumed) -> None:
    lengths = _lengths()
    straight = BucketBatchSampler(lengths, 1024, seed=5, rank=1, world_size=2)
    full = straight.batches_for_epoch(2) + straight.batches_for_epoch(3)
    a = BucketBatchSampler(lengths, 1024, seed=5, rank=1, world_size=2)
    a.set_epoch(2)
    k = len(a) if consumed == "all" else consumed
    it = iter(a)
    got = [next(it) for _ in range(k)]
    state = a.state_dict()
    assert state["epoch"] == 2 and state["batches_consumed"] == k
    b = BucketBatchSampler(lengths, 1024, seed=5, rank=1, world_size=2)
    b.load_state_dict(state)
    rest = list(b)
    if k == len(a):  # resumed exactly at the epoch end: next epoch starts
        assert rest == straight.batches_for_epoch(3)
    else:
        rest += list(b)
    assert got + rest == full


def test_load_state_dict_refuses_other_sharding() -> None:
    s = BucketBatchSampler(_lengths(), 1024, world_size=2)
    t = BucketBatchSampler(_lengths(), 1024, world_size=4)
    with pytest.raises(ValueError, match=r"world_size=2 but this run has world_size=4"):
        t.load_state_dict(s.state_dict())


def test_fixed_order_for_validation() -> None:
    lengths = _lengths()
    s = BucketBatchSampler(lengths, 1024, shuffle=False)
    b0 = s.batches_for_epoch(0)
    assert b0 == s.batches_for_epoch(9)
    flat = [i for b in b0 for i in b]
    assert np.all(np.diff(lengths[flat]) >= 0)  # sorted by length


def test_padding_efficiency_hand_computed() -> None:
    lengths = np.array([2, 4, 3])
    assert padding_efficiency([[0, 1], [2]], lengths) == pytest.approx(9 / 11)


def test_padding_efficiency_beats_random_batching_long_tail() -> None:
    lengths = _lognormal()
    assert 2600 < np.median(lengths) < 3000 and lengths.max() == 8192
    budget = 16384
    s = BucketBatchSampler(lengths, budget, num_buckets=16, seed=0)
    bucketed = s.padding_efficiency(0)
    rand = padding_efficiency(random_batches(lengths, budget, seed=0), lengths)
    print(f"padding efficiency: bucketed {bucketed:.4f}  random {rand:.4f}")
    assert bucketed == pytest.approx(padding_efficiency(s.global_batches_for_epoch(0), lengths))
    assert bucketed > 0.93 and rand < 0.8
    assert bucketed > rand + 0.15
