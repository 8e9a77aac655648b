"""Lightning data module: shards -> validated, split, bucketed, resumable train/val loaders."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from dflash_lit.data.bucketing import BucketBatchSampler
from dflash_lit.data.collate import PadCollator
from dflash_lit.data.shards import OVERLENGTH_MODES, FilterReport, ShardDataset, load_shards
from dflash_lit.hashing import blake2b_64

log = logging.getLogger(__name__)


def id_hash(ids: list[str]) -> np.ndarray:
    """Deterministic uniform value in [0, 1) per id (blake2b), independent of row order."""
    return np.asarray([blake2b_64(s, "big") for s in ids], dtype=np.float64) / 2.0**64


class DFlashDataModule(L.LightningDataModule):
    """Regenerated-completion shards as train/val loaders for DFlash training.

    The train loader is a torchdata ``StatefulDataLoader`` over a :class:`BucketBatchSampler`,
    so Lightning saves the data position in every checkpoint and a resumed run continues with
    the exact next batch (mid-epoch or at an epoch boundary). Under DDP the sampler shards by
    rank itself: use ``Trainer(use_distributed_sampler=False)``.

    Args:
        path: training shards (dir of ``*.parquet`` / ``*.arrow``, one file, or a save_to_disk dir).
        val_path: separate validation shards; excludes ``val_fraction`` / ``val_size``.
        val_fraction: share of ``path``'s rows held out for validation, chosen by a hash of
            ``id`` (deterministic, order-independent; rows sharing an id share a split);
            ``None``: 0.01 unless ``val_size`` or ``val_path`` is given.
        val_size: alternatively, hold out exactly this many rows (the smallest id hashes).
        max_length: longest sequence fed to the model (tokens).
        overlength: rows longer than ``max_length``: ``'truncate'`` or ``'drop'``.
        block_size: drafter block size; only sets the ``min_completion_tokens`` default.
        min_completion_tokens: drop rows with fewer completion tokens; ``None`` = 2*block_size.
        token_budget: max ``batch_size * max_len_in_batch`` per batch (padding counted);
            must be >= ``max_length``.
        num_buckets: length buckets from quantiles (ignored if ``boundaries`` is given).
        boundaries: explicit inclusive upper bucket edges (tokens).
        seed: shuffling seed (the epoch order depends on seed and epoch only).
        pad_token_id: id written into padding positions.
        vocab_size: if given, shards with token ids outside ``[0, vocab_size)`` are rejected.
        num_workers: loader worker processes (0 = load in the main process).
        pin_memory: pin batches (for GPU training).
        pad_to_multiple_of: round the padded length up to a multiple of this.
        cache_dir: ``datasets`` cache for Parquet converted to Arrow (default: HF cache).

    After ``setup``: ``filter_report`` / ``val_filter_report`` (:class:`FilterReport`),
    ``filter_counts`` (dict), ``train_dataset`` / ``val_dataset``; ``padding_efficiency`` is
    the real/padded token ratio of the current training epoch.
    """

    def __init__(
        self,
        path: str,
        val_path: str | None = None,
        val_fraction: float | None = 0.0,
        val_size: int = 0,
        max_length: int = 3072,
        overlength: str = "truncate",
        block_size: int = 16,
        min_completion_tokens: int | None = None,
        token_budget: int = 16384,
        num_buckets: int = 16,
        boundaries: list[int] | None = None,
        seed: int = 0,
        pad_token_id: int = 0,
        vocab_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        pad_to_multiple_of: int = 1,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if overlength not in OVERLENGTH_MODES:
            raise ValueError(
                f"data.overlength must be one of {OVERLENGTH_MODES}, got {overlength!r}"
            )
        if max_length > token_budget:
            raise ValueError(
                f"data.max_length={max_length} exceeds data.token_budget={token_budget}: a "
                "maximal sequence would not fit a batch; raise token_budget or lower max_length"
            )
        if val_fraction is None:  # conf/data/shards.yaml: 1 % unless val_size / val_path is given
            val_fraction = 0.0 if (val_size or val_path is not None) else 0.01
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        if val_size < 0:
            raise ValueError(f"data.val_size must be >= 0, got {val_size}")
        if val_fraction and val_size:
            raise ValueError("set data.val_fraction or data.val_size, not both")
        if val_path is not None and (val_fraction or val_size):
            raise ValueError("data.val_path excludes data.val_fraction / data.val_size")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")
        # No save_hyperparameters(): Lightning refuses to log when a module hparam of the same
        # name (seed, max_length, vocab_size, ...) differs; the Hydra config records these.
        self.path = path
        self.val_path = val_path
        self.val_fraction = val_fraction
        self.val_size = val_size
        self.max_length = max_length
        self.overlength = overlength
        self.min_completion_tokens = (
            2 * block_size if min_completion_tokens is None else min_completion_tokens
        )
        self.token_budget = token_budget
        self.num_buckets = num_buckets
        self.boundaries = list(boundaries) if boundaries is not None else None
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.collate = PadCollator(pad_token_id, pad_to_multiple_of)
        self.cache_dir = cache_dir
        self.train_dataset: ShardDataset | None = None
        self.val_dataset: ShardDataset | None = None
        self.filter_report: FilterReport | None = None
        self.val_filter_report: FilterReport | None = None
        self._train_sampler: BucketBatchSampler | None = None

    # ------------------------------------------------------------------ loading
    def _load(self, path: str, what: str) -> tuple[ShardDataset, FilterReport]:
        return load_shards(
            path,
            max_length=self.max_length,
            overlength=self.overlength,
            min_completion_tokens=self.min_completion_tokens,
            vocab_size=self.vocab_size,
            cache_dir=self.cache_dir,
            what=what,
        )

    def setup(self, stage: str | None = None) -> None:
        """Load, validate, filter, split. Idempotent: call it early to fail before models load."""
        if self.train_dataset is not None:
            return
        data, self.filter_report = self._load(self.path, "data.path")
        if len(data) == 0:
            raise ValueError(
                f"data.path '{self.path}': no rows left after filtering "
                f"({self.filter_report.summary()}); check min_completion_tokens / max_length"
            )
        if self.val_path is not None:
            self.train_dataset = data
            self.val_dataset, self.val_filter_report = self._load(self.val_path, "data.val_path")
        elif self.val_fraction or self.val_size:
            h = id_hash(data.ids)
            if self.val_size:
                if self.val_size >= len(data):
                    raise ValueError(
                        f"data.val_size={self.val_size} leaves no training rows ({len(data)} kept)"
                    )
                is_val = np.zeros(len(data), dtype=bool)
                is_val[np.argsort(h, kind="stable")[: self.val_size]] = True
            else:
                is_val = h < self.val_fraction
            self.train_dataset = data.subset(np.flatnonzero(~is_val))
            self.val_dataset = data.subset(np.flatnonzero(is_val))
        else:
            self.train_dataset = data
        if len(self.train_dataset) == 0:
            raise ValueError("the validation split took every row: lower data.val_fraction")
        log.info(
            "data: %d train rows, %d val rows, padding efficiency %.3f",
            len(self.train_dataset),
            len(self.val_dataset) if self.val_dataset is not None else 0,
            self.padding_efficiency,
        )

    @property
    def filter_counts(self) -> dict[str, int]:
        """Training-shard filter counts per reason (empty before ``setup``)."""
        return self.filter_report.as_dict() if self.filter_report is not None else {}

    # ------------------------------------------------------------------ trainer wiring
    def _rank_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    def _trainer_epoch(self) -> int:
        """The epoch Lightning is about to run (``processed`` survives an end-of-epoch save)."""
        trainer = getattr(self, "trainer", None)
        try:
            progress = trainer.fit_loop.epoch_progress  # type: ignore[union-attr]
            return int(progress.current.processed)
        except AttributeError:
            return 0

    def _check_no_distributed_sampler(self, world: int) -> None:
        conn = getattr(getattr(self, "trainer", None), "_accelerator_connector", None)
        if world > 1 and getattr(conn, "use_distributed_sampler", False):
            raise ValueError(
                "DFlashDataModule shards batches across ranks itself: set "
                "Trainer(use_distributed_sampler=False) (trainer.use_distributed_sampler=false)"
            )

    def _sampler(self, data: ShardDataset, shuffle: bool) -> BucketBatchSampler:
        rank, world = self._rank_world()
        return BucketBatchSampler(
            data.lengths,
            self.token_budget,
            boundaries=self.boundaries,
            num_buckets=self.num_buckets,
            seed=self.seed,
            rank=rank,
            world_size=world,
            shuffle=shuffle,
            max_length=self.max_length,
        )

    @property
    def train_sampler(self) -> BucketBatchSampler:
        """The training batch sampler (built on first use)."""
        if self._train_sampler is None:
            self.setup()
            assert self.train_dataset is not None
            self._train_sampler = self._sampler(self.train_dataset, shuffle=True)
        return self._train_sampler

    def train_batches_per_epoch(self, world_size: int | None = None) -> int:
        """Batches per epoch on each rank for ``world_size`` ranks (default: the trainer's).

        Exact for every epoch (the bucket batch sizes are fixed): ``ceil(T / world_size)`` with
        ``T`` the global batch count, as the sampler equalises ranks by splitting batches.
        """
        world = self._rank_world()[1] if world_size is None else int(world_size)
        return -(-self.train_sampler.num_global_batches // world)

    @property
    def padding_efficiency(self) -> float:
        """Real / padded tokens of the current training epoch (all ranks)."""
        return self.train_sampler.padding_efficiency()

    # ------------------------------------------------------------------ loaders
    def train_dataloader(self) -> StatefulDataLoader:
        """Bucketed, shuffled, rank-sharded, resumable loader (state saved by Lightning)."""
        self.setup()
        assert self.train_dataset is not None
        _, world = self._rank_world()
        self._check_no_distributed_sampler(world)
        # A fresh sampler at the epoch Lightning runs next: right even when Lightning restores
        # no loader state (an end-of-epoch checkpoint of an epoch-based run); a saved
        # mid-epoch position, when there is one, is loaded on top by the loader.
        self._train_sampler = self._sampler(self.train_dataset, shuffle=True)
        self._train_sampler.set_epoch(self._trainer_epoch())
        return StatefulDataLoader(
            self.train_dataset,
            batch_sampler=self._train_sampler,
            collate_fn=self.collate,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )

    def val_dataloader(self) -> torch.utils.data.DataLoader | list:
        """Fixed-order loader (sorted by length, same every epoch); ``[]`` without a val set."""
        self.setup()
        if self.val_dataset is None or len(self.val_dataset) == 0:
            return []
        _, world = self._rank_world()
        self._check_no_distributed_sampler(world)
        return torch.utils.data.DataLoader(
            self.val_dataset,
            batch_sampler=self._sampler(self.val_dataset, shuffle=False),
            collate_fn=self.collate,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the data position travels in the loader state Lightning saves."""
        return {}
