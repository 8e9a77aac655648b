"""Length-bucketed, token-budgeted, rank-sharded, resumable batch sampler.

Batches are formed within length buckets so a batch holds sequences of similar length
(little padding); each bucket has one fixed batch size ``max(1, token_budget // L_max)``
where ``L_max`` is the longest sequence in the bucket, so every batch costs
``batch_size * max_len_in_batch <= token_budget`` (padding counted).

Why a fixed batch size per bucket instead of greedy packing: the number of batches per
epoch is then the same in every epoch, so ``len(sampler)`` is exact for every epoch
(Lightning reads it once; LR schedules are sized from it) and all ranks get the same
count without per-epoch communication. Which sequences share a batch still changes every
epoch (members are shuffled within their bucket before chunking).

Everything is a pure function of ``(seed, epoch)`` (NumPy ``SeedSequence([seed, epoch])``,
no torch RNG), so a resumed run rebuilds the identical epoch and skips what was consumed.

Equal counts across ranks: when the number of batches T is not a multiple of the world size
W, the largest batches are split in two (each half is still within budget) until it is;
every sequence is then still seen exactly once per epoch, with disjoint ranks. Only if no
batch can be split (all singletons) are the first batches of the shuffled order repeated
(documented fallback, never silent: ``num_repeated`` says how many).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np


class _EpochHook:
    """What Lightning sees as ``batch_sampler.sampler``: it calls ``set_epoch`` on it each epoch.

    Lightning only calls ``set_epoch`` on ``loader.sampler`` and ``loader.batch_sampler.sampler``
    (not on the batch sampler itself), so this forwards the call.
    """

    def __init__(self, owner: BucketBatchSampler) -> None:
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)


def quantile_boundaries(lengths: np.ndarray, num_buckets: int) -> list[int]:
    """Upper bucket edges (inclusive) at the length quantiles i/num_buckets, i = 1..num_buckets-1.

    Duplicate edges (many equal lengths) collapse, so fewer buckets may result.
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    if num_buckets == 1 or len(lengths) == 0:
        return []
    qs = np.quantile(np.asarray(lengths, dtype=np.float64), np.arange(1, num_buckets) / num_buckets)
    return sorted({int(np.ceil(q)) for q in qs})


def padding_efficiency(batches: Sequence[Sequence[int]], lengths: np.ndarray) -> float:
    """Real tokens / padded tokens over ``batches`` (a batch pads to its longest sequence)."""
    real = padded = 0
    for b in batches:
        lens = lengths[np.asarray(b, dtype=np.int64)]
        real += int(lens.sum())
        padded += len(lens) * int(lens.max())
    return real / padded if padded else 1.0


def pack_greedy(order: Sequence[int], lengths: np.ndarray, token_budget: int) -> list[list[int]]:
    """Pack sequences in ``order`` into consecutive batches under ``token_budget``.

    A batch is closed when adding the next sequence would make
    ``(batch_size + 1) * max_len`` exceed ``token_budget``.
    """
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        n = int(lengths[i])
        if cur and (len(cur) + 1) * max(cur_max, n) > token_budget:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    return batches


def random_batches(lengths: np.ndarray, token_budget: int, seed: int = 0) -> list[list[int]]:
    """Baseline without bucketing: shuffle all sequences, then ``pack_greedy`` under the
    budget. Used to measure what bucketing buys."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    return pack_greedy(order.tolist(), lengths, token_budget)


class BucketBatchSampler:
    """Yields this rank's batches (lists of dataset indices) for the current epoch.

    Args:
        lengths: token count of every sequence (index i = dataset row i).
        token_budget: max ``batch_size * max_len_in_batch`` per batch (padding counted).
        boundaries: inclusive upper length edges of the buckets (bucket i holds lengths in
            ``(boundaries[i-1], boundaries[i]]``, the last bucket everything above); ``None``
            derives them from the length quantiles with ``num_buckets``.
        num_buckets: number of quantile buckets when ``boundaries`` is ``None``.
        seed: shuffling seed; the epoch order depends on ``(seed, epoch)`` only.
        rank, world_size: this process's shard; every rank gets ``len(self)`` batches.
        shuffle: ``False`` gives a fixed order (sorted by length within each bucket, buckets in
            increasing length, no shuffling): for validation.
        max_length: if given, the longest sequence the data may hold; it must fit the budget.

    State (``state_dict``): ``epoch`` and ``batches_consumed`` (batches of this epoch already
    handed out on this rank), plus ``world_size`` / ``num_batches`` to refuse a resume with a
    different sharding. Iterating resumes at ``batches_consumed``; iterating again after an
    epoch was fully consumed starts the next epoch (so an exhausted epoch is never replayed
    as an empty one); ``set_epoch(e)`` with a new ``e`` starts epoch ``e`` from its beginning.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        token_budget: int,
        *,
        boundaries: Sequence[int] | None = None,
        num_buckets: int = 16,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        max_length: int | None = None,
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1:
            raise ValueError(f"lengths must be 1-D, got shape {self.lengths.shape}")
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if max_length is not None and max_length > token_budget:
            raise ValueError(
                f"max_length={max_length} exceeds token_budget={token_budget}: a maximal "
                "sequence would not fit a batch; raise token_budget or lower max_length"
            )
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        if len(self.lengths) and self.lengths.min() < 1:
            raise ValueError("every sequence needs length >= 1")
        self.token_budget = int(token_budget)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.shuffle = bool(shuffle)
        if boundaries is None:
            boundaries = quantile_boundaries(self.lengths, num_buckets)
        bnd = [int(b) for b in boundaries]
        if any(b2 <= b1 for b1, b2 in zip(bnd, bnd[1:])):
            raise ValueError(f"bucket boundaries must be strictly increasing, got {bnd}")
        self.boundaries = bnd

        # Sequences longer than the budget each get a batch of their own.
        idx = np.arange(len(self.lengths))
        over = self.lengths > self.token_budget
        self._oversize = idx[over]
        fit = idx[~over]
        bucket_of = np.searchsorted(np.asarray(bnd, dtype=np.int64), self.lengths[fit], side="left")
        self._buckets: list[np.ndarray] = []  # member indices, sorted by (length, index)
        self._bucket_bs: list[int] = []  # fixed batch size per bucket
        for b in range(len(bnd) + 1):
            members = fit[bucket_of == b]
            if len(members) == 0:
                continue
            members = members[np.lexsort((members, self.lengths[members]))]
            self._buckets.append(members)
            self._bucket_bs.append(max(1, self.token_budget // int(self.lengths[members].max())))
        base = sum(-(-len(m) // bs) for m, bs in zip(self._buckets, self._bucket_bs))
        self._num_global = base + len(self._oversize)  # before equalising across ranks
        self._num_padded = -(-self._num_global // self.world_size) * self.world_size
        self.epoch = 0
        self.batches_consumed = 0
        self._cache: tuple[int, list[list[int]]] | None = None
        self.num_repeated = 0  # batches repeated to equalise ranks (same for every epoch)
        self.global_batches_for_epoch(0)  # sets num_repeated; batch sizes do not vary by epoch
        self.sampler = _EpochHook(self)  # Lightning calls batch_sampler.sampler.set_epoch(epoch)

    # ----------------------------------------------------------------- pure epoch functions
    def global_batches_for_epoch(self, epoch: int) -> list[list[int]]:
        """All ranks' batches of ``epoch`` in order (rank r takes positions r, r+W, ...)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        rng = np.random.default_rng([self.seed, int(epoch)])
        batches: list[np.ndarray] = []
        for members, bs in zip(self._buckets, self._bucket_bs):
            if self.shuffle:
                members = members[rng.permutation(len(members))]
            batches.extend(members[i : i + bs] for i in range(0, len(members), bs))
        batches.extend(self._oversize[i : i + 1] for i in range(len(self._oversize)))
        batches = self._equalise(batches)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        out = [b.tolist() for b in batches]
        self._cache = (int(epoch), out)
        return out

    def batches_for_epoch(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch`` (a pure function of seed, epoch, rank, world size)."""
        return self.global_batches_for_epoch(epoch)[self.rank :: self.world_size]

    def _equalise(self, batches: list[np.ndarray]) -> list[np.ndarray]:
        """Make the batch count a multiple of world_size: split the largest, else repeat."""
        need = self._num_padded - len(batches)
        self.num_repeated = 0
        while need > 0:
            sizes = [len(b) for b in batches]
            j = int(np.argmax(sizes))  # first largest: deterministic
            if sizes[j] < 2:
                break
            b = batches[j]
            half = (len(b) + 1) // 2
            batches[j : j + 1] = [b[:half], b[half:]]
            need -= 1
        if need > 0:  # only singletons left: repeat the first batches of this order
            self.num_repeated = need
            batches.extend(batches[i % len(batches)] for i in range(need))
        return batches

    def padding_efficiency(self, epoch: int | None = None) -> float:
        """Real / padded tokens over all ranks' batches of ``epoch`` (default: current epoch)."""
        e = self.epoch if epoch is None else epoch
        return padding_efficiency(self.global_batches_for_epoch(e), self.lengths)

    # ----------------------------------------------------------------- sampler protocol
    @property
    def num_global_batches(self) -> int:
        """Batches per epoch over all ranks before equalising (same for every epoch)."""
        return self._num_global

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same for every epoch and every rank)."""
        return self._num_padded // self.world_size

    def __iter__(self) -> Iterator[list[int]]:
        # Generator body runs lazily on the first next(), after Lightning's set_epoch/resume.
        if self.batches_consumed >= len(self):
            # The epoch was fully consumed (e.g. a checkpoint right after its last batch):
            # move on instead of replaying it as an empty epoch.
            self.epoch += 1
            self.batches_consumed = 0
        epoch = self.epoch
        batches = self.batches_for_epoch(epoch)
        while self.batches_consumed < len(batches) and self.epoch == epoch:
            b = batches[self.batches_consumed]
            self.batches_consumed += 1  # counted before the yield: state == batches handed out
            yield b

    def upcoming(self, n: int) -> list[list[int]]:
        """The next ``n`` batches this sampler will hand out from its position (into the next
        epoch when this one ends), without consuming them: what a prefetch should ask for."""
        out: list[list[int]] = []
        epoch, consumed = self.epoch, self.batches_consumed
        while len(out) < n and len(self):
            if consumed >= len(self):
                epoch, consumed = epoch + 1, 0
            take = self.batches_for_epoch(epoch)[consumed:consumed + n - len(out)]
            out += take
            consumed += len(take)
        return out

    def set_epoch(self, epoch: int) -> None:
        """Switch to ``epoch`` (from its start) if it differs from the current one; else no-op.

        A no-op for the same epoch keeps a restored mid-epoch position (Lightning calls this
        after restoring the loader state).
        """
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.batches_consumed = 0

    def state_dict(self) -> dict[str, Any]:
        """Position: ``{epoch, batches_consumed, world_size, num_batches}``."""
        return {
            "epoch": self.epoch,
            "batches_consumed": self.batches_consumed,
            "world_size": self.world_size,
            "num_batches": len(self),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` left off (refuses a different sharding)."""
        if "world_size" in state and int(state["world_size"]) != self.world_size:
            raise ValueError(
                f"sampler state was saved with world_size={state['world_size']} but this run has "
                f"world_size={self.world_size}: resume with the same number of devices"
            )
        if "num_batches" in state and int(state["num_batches"]) != len(self):
            raise ValueError(
                f"sampler state was saved with {state['num_batches']} batches per epoch but "
                f"the data now gives {len(self)}: the dataset, max_length, token_budget or "
                "buckets changed"
            )
        consumed = int(state["batches_consumed"])
        if not 0 <= consumed <= len(self):
            raise ValueError(f"batches_consumed={consumed} outside [0, {len(self)}]")
        self.epoch = int(state["epoch"])
        self.batches_consumed = consumed
