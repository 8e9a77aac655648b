"""Shards (write/load/validate/filter), collate, split, rank wiring, and exact Lightning resume."""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from dflash_lit.data.collate import PadCollator
from dflash_lit.data.datamodule import DFlashDataModule
from dflash_lit.data.shards import ShardError, load_shards, write_shards


def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(40, 200))
        prompt = int(rng.integers(4, 20))
        out.append(
            dict(
                id=f"r{i}",
                source="synthetic",
                input_ids=rng.integers(0, 100, length).tolist(),
                loss_mask=[0] * prompt + [1] * (length - prompt),
            )
        )
    return out


def _row(id_: str, ids: list[int], mask: list[int]) -> dict:
    return dict(id=id_, source="t", input_ids=ids, loss_mask=mask)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("shards")
    write_shards(_rows(120), d / "data", rows_per_shard=50)
    return d


# --------------------------------------------------------------------------- shards
def test_write_and_load_roundtrip(shard_dir: Path) -> None:
    files = sorted((shard_dir / "data").glob("*.parquet"))
    assert [f.name for f in files] == [
        "shard-00000.parquet",
        "shard-00001.parquet",
        "shard-00002.parquet",
    ]
    ds, report = load_shards(
        shard_dir / "data", min_completion_tokens=1, cache_dir=str(shard_dir / "c")
    )
    rows = _rows(120)
    assert len(ds) == 120 and report.kept == 120 and report.total == 120
    assert ds.ids == [r["id"] for r in rows]
    for i in (0, 49, 50, 119):
        item = ds[i]
        assert item["input_ids"].tolist() == rows[i]["input_ids"]
        assert item["loss_mask"].tolist() == rows[i]["loss_mask"]
        assert item["index"] == i
    batch = ds.__getitems__([119, 0, 60])  # spans three shards, keeps the requested order
    assert [b["index"] for b in batch] == [119, 0, 60]
    assert batch[2]["input_ids"].tolist() == rows[60]["input_ids"]


def test_glob_selects_a_subset_of_shards(shard_dir: Path) -> None:
    """A glob over shard files loads just those shards, in name order; one matching nothing is
    a one-line error naming the key."""
    ds, _ = load_shards(shard_dir / "data" / "shard-0000[02].parquet", min_completion_tokens=1,
                        cache_dir=str(shard_dir / "c"))
    rows = _rows(120)
    assert ds.ids == [r["id"] for r in rows[:50] + rows[100:]]
    assert ds[50]["input_ids"].tolist() == rows[100]["input_ids"]
    with pytest.raises(ShardError, match=r"data\.path: the pattern '.*shard-9\*' matches no"):
        load_shards(shard_dir / "data" / "shard-9*")


def test_arrow_files_and_save_to_disk(tmp_path: Path) -> None:
    import datasets

    rows = _rows(30)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "std"))
    ds, _ = load_shards(tmp_path / "std", min_completion_tokens=1)
    assert ds.ids == [r["id"] for r in rows] and ds[7]["input_ids"].tolist() == rows[7]["input_ids"]
    (tmp_path / "arrow").mkdir()
    for f in (tmp_path / "std").glob("*.arrow"):
        shutil.copy(f, tmp_path / "arrow" / f.name)
    ds2, _ = load_shards(tmp_path / "arrow", min_completion_tokens=1)
    assert ds2.ids == ds.ids and ds2[29]["loss_mask"].tolist() == rows[29]["loss_mask"]


def test_error_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match=r"data\.path: '.*nope' does not exist"):
        load_shards(tmp_path / "nope")


def test_error_no_shards(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(
        ShardError, match=r"no shards in .*: searched \*\.parquet, \*\.arrow and a save_to_disk"
    ):
        load_shards(tmp_path)


def test_error_missing_column(tmp_path: Path) -> None:
    pq.write_table(
        pa.table({"id": ["a"], "source": ["s"], "input_ids": [[1, 2]]}), tmp_path / "a.parquet"
    )
    with pytest.raises(
        ShardError, match=r"a\.parquet: missing column 'loss_mask' \(has: id, source, input_ids\)"
    ):
        load_shards(tmp_path)


def test_error_mask_length_mismatch(tmp_path: Path) -> None:
    rows = [
        _row("ok0", [1, 2, 3], [0, 1, 1]),
        _row("ok1", [1, 2], [0, 1]),
        _row("bad", [1, 2, 3, 4, 5], [0, 1, 1, 1]),
    ]
    write_shards(rows, tmp_path)
    with pytest.raises(
        ShardError,
        match=r"shard-00000\.parquet: row id 'bad' \(row 2\): "
        r"loss_mask has 4 entries but input_ids has 5",
    ):
        load_shards(tmp_path, min_completion_tokens=1)


def test_error_token_id_out_of_vocab(tmp_path: Path) -> None:
    write_shards([_row("ok", [1, 2, 3], [0, 1, 1]), _row("big", [1, 120, 3], [0, 1, 1])], tmp_path)
    with pytest.raises(
        ShardError,
        match=r"shard-00000\.parquet: row id 'big' \(row 1\): token id 120 >= vocab_size 100",
    ):
        load_shards(tmp_path, vocab_size=100, min_completion_tokens=1)
    ds, _ = load_shards(tmp_path, vocab_size=121, min_completion_tokens=1)
    assert len(ds) == 2


def test_error_mask_not_binary(tmp_path: Path) -> None:
    write_shards([_row("two", [1, 2, 3], [0, 2, 1])], tmp_path)
    with pytest.raises(ShardError, match=r"row id 'two' \(row 0\): loss_mask value 2 is not 0/1"):
        load_shards(tmp_path, min_completion_tokens=1)


def _filter_rows() -> list[dict]:
    return [
        _row("zero", list(range(10)), [0] * 10),  # all-zero mask
        _row("long", list(range(50)), [0] * 10 + [1] * 40),  # 20 completion tokens in first 30
        _row("short", list(range(20)), [0] * 15 + [1] * 5),  # 5 < 8
        _row("lateans", list(range(40)), [0] * 35 + [1] * 5),  # 0 completion in first 30
        _row("fine", list(range(25)), [0] * 10 + [1] * 15),
    ]


def test_filters_truncate(tmp_path: Path, caplog) -> None:
    write_shards(_filter_rows(), tmp_path)
    with caplog.at_level(logging.INFO, logger="dflash_lit.data.shards"):
        ds, rep = load_shards(
            tmp_path, max_length=30, overlength="truncate", min_completion_tokens=8
        )
    assert rep.as_dict() == dict(
        total=5, kept=2, all_zero_mask=1, overlength_dropped=0, short_completion=2, truncated=1
    )
    assert "kept 2/5 rows" in caplog.text
    assert ds.ids == ["long", "fine"]
    assert ds.lengths.tolist() == [30, 25]
    assert ds[0]["input_ids"].tolist() == list(range(30))
    assert ds[0]["loss_mask"].tolist() == [0] * 10 + [1] * 20


def test_filters_drop(tmp_path: Path) -> None:
    write_shards(_filter_rows(), tmp_path)
    ds, rep = load_shards(tmp_path, max_length=30, overlength="drop", min_completion_tokens=8)
    assert rep.as_dict() == dict(
        total=5, kept=1, all_zero_mask=1, overlength_dropped=2, short_completion=1, truncated=0
    )
    assert ds.ids == ["fine"]
    with pytest.raises(
        ShardError, match=r"overlength must be one of \('truncate', 'drop'\), got 'cut'"
    ):
        load_shards(tmp_path, overlength="cut")


# --------------------------------------------------------------------------- collate
def test_collate_right_pads() -> None:
    samples = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "index": 4},
        {"input_ids": [8], "loss_mask": [1], "index": 9},
    ]
    b = PadCollator(pad_token_id=3, pad_to_multiple_of=4)(samples)
    assert b["input_ids"].tolist() == [[5, 6, 7, 3], [8, 3, 3, 3]]
    assert b["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert b["lengths"].tolist() == [3, 1] and b["index"].tolist() == [4, 9]
    assert all(t.dtype == torch.int64 for t in b.values())


# --------------------------------------------------------------------------- datamodule
def _dm(path: Path, cache: Path, **kw) -> DFlashDataModule:
    args = dict(
        max_length=256,
        token_budget=512,
        num_buckets=4,
        min_completion_tokens=8,
        cache_dir=str(cache),
    )
    args.update(kw)
    return DFlashDataModule(str(path), **args)


def _blake_frac(s: str) -> float:  # independent reference for the split hash
    return int(hashlib.blake2b(s.encode(), digest_size=8).hexdigest(), 16) / 2**64


def test_split_by_id_hash_is_order_independent(tmp_path: Path) -> None:
    rows = _rows(200, seed=1)
    write_shards(rows, tmp_path / "a", 64)
    write_shards(rows[::-1], tmp_path / "b", 33)
    expected = {r["id"] for r in rows if _blake_frac(r["id"]) < 0.25}
    splits = []
    for d in ("a", "b"):
        dm = _dm(tmp_path / d, tmp_path / "c", val_fraction=0.25, min_completion_tokens=1)
        dm.setup("fit")
        splits.append((set(dm.train_dataset.ids), set(dm.val_dataset.ids)))
    assert splits[0] == splits[1]
    train, val = splits[0]
    assert val == expected and not train & val and len(train | val) == 200
    dm = _dm(tmp_path / "b", tmp_path / "c", val_size=10, min_completion_tokens=1)
    dm.setup()
    smallest = sorted(rows, key=lambda r: _blake_frac(r["id"]))[:10]
    assert set(dm.val_dataset.ids) == {r["id"] for r in smallest}


def test_val_path_and_attributes(shard_dir: Path, tmp_path: Path) -> None:
    write_shards(_rows(10, seed=7), tmp_path / "val")
    dm = _dm(shard_dir / "data", tmp_path / "c", val_path=str(tmp_path / "val"))
    dm.setup()
    assert len(dm.val_dataset) == 10 and dm.val_filter_report.kept == 10
    assert dm.filter_counts["total"] == 120 and dm.filter_counts["kept"] == len(dm.train_dataset)
    assert 0.5 < dm.padding_efficiency <= 1.0
    val = dm.val_dataloader()
    first = [b["index"].tolist() for b in val]
    assert first == [b["index"].tolist() for b in dm.val_dataloader()]  # fixed order
    assert sorted(i for b in first for i in b) == list(range(10))


def test_config_errors(shard_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.max_length=4096 exceeds data\.token_budget=2048"):
        DFlashDataModule(str(shard_dir), max_length=4096, token_budget=2048)
    with pytest.raises(ValueError, match=r"data\.val_path excludes"):
        DFlashDataModule(str(shard_dir), val_path="x", val_fraction=0.1)
    dm = _dm(shard_dir / "data", shard_dir / "c", min_completion_tokens=10_000)
    with pytest.raises(ValueError, match=r"no rows left after filtering \(kept 0/120 rows"):
        dm.setup()


def test_rank_and_world_from_trainer(shard_dir: Path) -> None:
    seen = []
    for rank in range(2):
        dm = _dm(shard_dir / "data", shard_dir / "c")
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        loader = dm.train_dataloader()
        assert (loader.batch_sampler.rank, loader.batch_sampler.world_size) == (rank, 2)
        seen.append([i for b in loader for i in b["index"].tolist()])
        assert len(loader) == dm.train_batches_per_epoch() == dm.train_batches_per_epoch(2)
    assert len(seen[0]) + len(seen[1]) == 120 and sorted(seen[0] + seen[1]) == list(range(120))
    dm = _dm(shard_dir / "data", shard_dir / "c")
    dm.trainer = SimpleNamespace(
        global_rank=0,
        world_size=2,
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=True),
    )
    with pytest.raises(ValueError, match=r"Trainer\(use_distributed_sampler=False\)"):
        dm.train_dataloader()


# --------------------------------------------------------------------------- Lightning resume
class _Recorder(L.LightningModule):
    """Records (epoch, batch indices) of every training batch; one trivial parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, tuple[int, ...]]] = []
        self.epoch_batches: dict[int, int] = {}
        self.val_seen: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        e = self.trainer.current_epoch
        self.seen.append((e, tuple(batch["index"].tolist())))
        self.epoch_batches[e] = self.epoch_batches.get(e, 0) + 1
        return (self.w * batch["input_ids"].float().mean()).sum()

    def validation_step(self, batch, batch_idx):
        self.val_seen.setdefault(self.trainer.current_epoch, []).extend(batch["index"].tolist())

    def on_train_epoch_end(self) -> None:
        # an empty (replayed) epoch would show up here with no batches
        self.epoch_batches.setdefault(self.trainer.current_epoch, 0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(root: Path, **kw) -> L.Trainer:
    kw.setdefault("enable_checkpointing", "callbacks" in kw)
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        **kw,
    )


@pytest.mark.parametrize("num_workers", [0, 1])
def test_lightning_resume_is_exact(shard_dir: Path, tmp_path: Path, num_workers: int) -> None:
    def dm() -> DFlashDataModule:
        return _dm(shard_dir / "data", shard_dir / "c", val_fraction=0.1, num_workers=num_workers)

    probe = dm()
    nb, nval = len(probe.train_sampler), len(probe.val_dataset)
    total = 3 * nb
    straight = _Recorder()
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ck", filename="{step}", every_n_train_steps=1, save_top_k=-1
    )
    _trainer(tmp_path, max_steps=total, callbacks=[ckpt]).fit(straight, datamodule=dm())
    assert len(straight.seen) == total
    assert [e for e, _ in straight.seen] == [i // nb for i in range(total)]
    assert straight.val_seen[0] == straight.val_seen[1]  # validation order is fixed
    assert sorted(straight.val_seen[0]) == list(range(nval))
    # mid-epoch, last-but-one, exactly at the epoch boundary (after its last batch), just after
    points = [5, nb - 1, nb, nb + 1, 2 * nb] if num_workers == 0 else [5, nb]
    for n in points:
        resumed = _Recorder()
        _trainer(tmp_path, max_steps=total).fit(
            resumed, datamodule=dm(), ckpt_path=str(tmp_path / "ck" / f"step={n}.ckpt")
        )
        assert resumed.seen == straight.seen[n:], f"resume at step {n} diverged"
        assert all(c > 0 for c in resumed.epoch_batches.values()), resumed.epoch_batches


def test_lightning_resume_from_epoch_end_checkpoint(shard_dir: Path, tmp_path: Path) -> None:
    # epoch-based run: Lightning restores no loader state here, the epoch comes from the loop
    def dm() -> DFlashDataModule:
        return _dm(shard_dir / "data", shard_dir / "c")

    nb = len(dm().train_sampler)
    straight = _Recorder()
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ce",
        filename="{epoch}",
        every_n_epochs=1,
        save_top_k=-1,
        save_on_train_epoch_end=True,
    )
    _trainer(tmp_path, max_epochs=3, callbacks=[ckpt]).fit(straight, datamodule=dm())
    for e in (0, 1):
        resumed = _Recorder()
        _trainer(tmp_path, max_epochs=3).fit(
            resumed, datamodule=dm(), ckpt_path=str(tmp_path / "ce" / f"epoch={e}.ckpt")
        )
        assert resumed.seen == straight.seen[(e + 1) * nb :]
        assert sorted(resumed.epoch_batches) == list(range(e + 1, 3))


def test_shards_config_explicit_val_size_or_val_path_wins_over_the_default_fraction(tmp_path):
    """conf/data/shards.yaml holds out 1 % by default; `data.val_size=N` or `data.val_path=DIR`
    alone replaces that default instead of conflicting with it."""
    import hydra
    from train_utils import compose_train, make_shards

    train, val = make_shards(tmp_path / "train", n=40), make_shards(tmp_path / "val", n=4, seed=1)

    def dm(*ov: str) -> DFlashDataModule:
        cfg = compose_train(["data=shards", f"data.path={train}", "data.num_workers=0",
                             "data.pin_memory=false", *ov], tmp_path / "run")
        return hydra.utils.instantiate(cfg.data, vocab_size=128, block_size=8, seed=0)

    assert dm().val_fraction == 0.01
    sized = dm("data.val_size=2")
    sized.setup("fit")
    assert len(sized.val_dataset) == 2 and len(sized.train_dataset) == 38
    separate = dm(f"data.val_path={val}")
    separate.setup("fit")
    assert len(separate.val_dataset) == 4 and len(separate.train_dataset) == 40
    with pytest.raises(Exception, match="set data.val_fraction or data.val_size, not both"):
        dm("data.val_size=2", "data.val_fraction=0.1")  # both explicit: still a conflict
