"""Pretraining of the tiny target: packed next-token LM with a small Lightning loop.

The training stream is *step-indexed*: item ``j`` is chunk ``perm_e[j mod n]`` with
``e = j // n`` and ``perm_e`` a permutation seeded by (seed, e). With a sequential
``StatefulDataLoader`` the batch at every global step is a pure function of (seed, step), so an
interrupted run resumes from ``last.ckpt`` onto exactly the same data.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import PreTrainedTokenizerFast

from .model import TinyPreset


def pack_documents(tok: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Token ids of all ``texts``, each followed by ``<|endoftext|>``, concatenated (int32)."""
    eos = tok.eos_token_id
    ids: list[int] = []
    # The backend tokenizer directly: no per-call length warning, parallel over documents.
    for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def chunk(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping ``[n, seq_len]`` chunks of a packed stream (the tail is dropped)."""
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"packed stream of {ids.numel()} tokens is shorter than seq_len={seq_len}.")
    return ids[: n * seq_len].view(n, seq_len)


class StepIndexedChunks(Dataset):
    """``length`` items drawn epoch by epoch from seeded permutations of ``chunks``."""

    def __init__(self, chunks: torch.Tensor, length: int, seed: int):
        self.chunks, self.length, self.seed = chunks, length, seed
        self._perms: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.length

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(len(self.chunks), generator=g)
        return self._perms[epoch]

    def __getitem__(self, j: int) -> torch.Tensor:
        n = len(self.chunks)
        return self.chunks[self._perm(j // n)[j % n]].long()


def cosine_with_warmup(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1, then cosine down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


class TinyLM(pl.LightningModule):
    """Causal-LM pretraining of a HF model (loss = mean next-token CE over the chunk)."""

    def __init__(self, model: torch.nn.Module, preset: TinyPreset):
        super().__init__()
        self.model, self.p = model, preset

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss, prog_bar=False)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("val/loss", loss, batch_size=batch.shape[0])

    def configure_optimizers(self):
        p = self.p
        decay = [t for n, t in self.model.named_parameters() if t.ndim >= 2]
        no_decay = [t for n, t in self.model.named_parameters() if t.ndim < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": p.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=p.lr, betas=(0.9, 0.95), eps=1e-8,
        )
        # Total steps come from the preset, not trainer.estimated_stepping_batches
        # (that call drops the saved dataloader state on resume, Lightning #20550).
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: cosine_with_warmup(s, p.warmup_steps, p.max_steps, p.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ProgressLog(Callback):
    """Periodic log lines: step, loss, lr, tokens/s (this run), ETA."""

    def __init__(self, tokens_per_step: int, every: int, log: Callable[[str], None] = print):
        self.tps, self.every, self._log = tokens_per_step, every, log
        self.t0 = 0.0
        self.step0 = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.t0, self.step0 = time.time(), trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        s = trainer.global_step
        if s % self.every and s != trainer.max_steps:
            return
        dt = max(1e-9, time.time() - self.t0)
        rate = (s - self.step0) / dt
        eta = (trainer.max_steps - s) / max(rate, 1e-9)
        loss = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        val = trainer.callback_metrics.get("val/loss")
        vtxt = f" val {float(val):.3f}" if val is not None else ""
        self._log(f"step {s}/{trainer.max_steps} loss {loss:.3f}{vtxt} lr {lr:.2e} "
                 f"{rate * self.tps:.0f} tok/s elapsed {dt / 60:.1f}m eta {eta / 60:.1f}m")


class Snapshot(Callback):
    """Calls ``export(model, step)`` every ``every`` steps so a killed run leaves a usable model."""

    def __init__(self, export: Callable[[torch.nn.Module, int], None], every: int):
        self.export, self.every = export, every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        s = trainer.global_step
        if s % self.every == 0 and s != trainer.max_steps:
            self.export(pl_module.model, s)


@torch.no_grad()
def mean_loss(model: torch.nn.Module, chunks: torch.Tensor, batch_size: int) -> float:
    """Token-weighted mean next-token CE of ``model`` over ``chunks`` (eval mode, fp32)."""
    was = model.training
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(chunks), batch_size):
        b = chunks[i: i + batch_size].long()
        k = b.shape[0] * (b.shape[1] - 1)
        tot += float(model(input_ids=b, labels=b).loss) * k
        n += k
    model.train(was)
    return tot / max(1, n)


def pretrain(model: torch.nn.Module, preset: TinyPreset, seed: int, train_chunks: torch.Tensor,
             val_chunks: torch.Tensor, work_dir: Path, export: Callable[[torch.nn.Module, int], None],
             max_minutes: float | None = None, resume: bool = True,
             log: Callable[[str], None] = print, callbacks: Sequence[Callback] = ()) -> dict:
    """Train ``model`` in place for ``preset.max_steps`` steps; returns run statistics.

    Checkpoints go to ``work_dir/ckpt/last.ckpt`` every ``ckpt_every`` steps (and resume from
    there when ``resume``); ``export`` is called at the same cadence for a HF snapshot.
    ``callbacks`` are extra Lightning callbacks (tests use one to simulate a crash).
    """
    p = preset
    pl.seed_everything(seed, workers=True, verbose=False)
    ds = StepIndexedChunks(train_chunks, p.max_steps * p.batch_size, seed)
    train_dl = StatefulDataLoader(ds, batch_size=p.batch_size, shuffle=False, num_workers=0)
    val_dl = StatefulDataLoader(list(val_chunks.long()), batch_size=p.batch_size, num_workers=0)
    ckpt_dir = work_dir / "ckpt"
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=p.ckpt_every, save_last=True,
                           save_top_k=0, save_on_train_epoch_end=False)
    tokens_per_step = p.batch_size * p.seq_len
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision="32-true", max_steps=p.max_steps, max_epochs=1,
        max_time={"minutes": max_minutes} if max_minutes else None,
        val_check_interval=min(p.val_every, p.max_steps), check_val_every_n_epoch=None,
        num_sanity_val_steps=0, gradient_clip_val=p.grad_clip, logger=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        default_root_dir=str(work_dir),
        callbacks=[ckpt, ProgressLog(tokens_per_step, max(1, min(25, p.max_steps // 10)), log),
                   Snapshot(export, p.ckpt_every), *callbacks],
    )
    module = TinyLM(model, p)
    last = ckpt_dir / "last.ckpt"
    ckpt_path = str(last) if resume and last.exists() else None
    if ckpt_path:
        log(f"resuming from {ckpt_path}")
    t0 = time.time()
    trainer.fit(module, train_dataloaders=train_dl, val_dataloaders=val_dl, ckpt_path=ckpt_path)
    steps = trainer.global_step
    return {
        "steps": steps,
        "max_steps": p.max_steps,
        "completed": steps >= p.max_steps,
        "tokens_seen": steps * tokens_per_step,
        "train_wall_s_this_run": round(time.time() - t0, 1),
        "resumed_from": ckpt_path,
    }
