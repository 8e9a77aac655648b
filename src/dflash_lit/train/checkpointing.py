"""When and how checkpoints are written: atomically, at cadences, at the final step, on preemption.

- **Atomic writes** (:class:`AtomicCheckpointIO`). Lightning's default IO streams the pickle
  straight into the final path, so a SIGKILL during a save leaves a truncated ``last.ckpt``.
  Here every checkpoint goes to a temporary name in the same directory, is flushed and
  fsync'ed, then ``os.replace``d over the target (atomic on POSIX); loads fail with one line
  naming the file. Temporaries of dead writers are removed at start (``atomic.py``).
- **``last.ckpt`` is always where the run stopped.** Lightning's ModelCheckpoint saves on its
  cadence; :class:`FinalCheckpoint` adds the final step when it falls between cadences;
  :class:`PreemptionCheckpoint` saves and stops on SIGTERM / SIGUSR1 at the next step
  boundary (SLURM sends SIGUSR1 with ``#SBATCH --signal=SIGUSR1@90`` before the time limit and
  SIGTERM on cancel; with ``requeue=true`` it also runs ``scontrol requeue``); a stop after
  ``max_nonfinite_in_row`` skipped steps saves too (``DFlashModule``). Every save happens in
  ``on_train_batch_end``, never after the loop stopped, so ``ckpt_path=last`` continues
  bit-exactly.

What a checkpoint holds is ``dflash_lit/checkpoint.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info

from dflash_lit.atomic import atomic_write
from dflash_lit.checkpoint import safe_load
from dflash_lit.errors import UserError


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` via tmp + fsync + rename."""
    atomic_write(path, lambda f: torch.save(obj, f), what="checkpoint",
                 intact="the previous checkpoints in that directory are intact")


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO with atomic saves and safe, readable loads (``checkpoint.safe_load``:
    weights only, so a resume file runs no code; ``trust`` unpickles a trusted legacy file)."""

    def __init__(self, trust: bool = False) -> None:
        self.trust = trust

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"checkpoint {p} does not exist")
        try:
            return safe_load(p, self.trust, key="ckpt_path")
        except UserError as e:
            if "not a readable checkpoint" not in str(e):
                raise
            raise UserError(
                f"checkpoint {p} is corrupt or truncated ({e}); resume from an earlier "
                "checkpoint in the same directory"
            ) from None


def checkpoint_dir(trainer) -> Path:
    """Where the run's ModelCheckpoint writes (``<run>/checkpoints`` without one)."""
    cb = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
    if cb is not None and cb.dirpath:
        return Path(cb.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint that keeps one ``last.ckpt`` per run.

    A run stopped inside an epoch (``max_steps``, a preemption signal, non-finite steps) has
    its ``last.ckpt`` written at that step boundary by :class:`FinalCheckpoint` /
    :class:`PreemptionCheckpoint`. Lightning would then save "last" once more when the
    stopped epoch loop ends, under a new name (``last-v1.ckpt``, its version counter) and with
    the epoch marked complete, so a resume from it would skip the rest of the epoch's data.
    Here the epoch-end, validation-end and train-end saves of such a stopped epoch are skipped, and
    "last" is never versioned: ``last.ckpt`` is overwritten.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(*args, **kwargs)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self._stopped_inside_epoch(trainer):
            super().on_train_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self._stopped_inside_epoch(trainer):
            super().on_validation_end(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if not self._stopped_inside_epoch(trainer):
            super().on_train_end(trainer, pl_module)

    @staticmethod
    def _stopped_inside_epoch(trainer) -> bool:
        """The loop ends before the epoch's last batch (``last.ckpt`` is already written)."""
        stopping = bool(trainer.should_stop) or 0 < trainer.max_steps <= trainer.global_step
        return stopping and not trainer.is_last_batch


class FinalCheckpoint(Callback):
    """Write ``last.ckpt`` at the run's final step when no cadence checkpoint falls on it.

    Lightning saves on its cadences only (every N steps / epochs), so a run ending by
    ``max_steps`` or ``max_epochs`` between them would leave ``last.ckpt`` behind its final
    weights. The save happens at the last step boundary (``on_train_batch_end``, where
    ModelCheckpoint saves too), never after the loop has stopped, so resuming it with a
    larger budget continues exactly.
    """

    def __init__(self, filename: str = "last.ckpt") -> None:
        self.filename = filename

    @staticmethod
    def _final_step(trainer) -> bool:
        if 0 < trainer.max_steps <= trainer.global_step:
            return True
        max_epochs = trainer.max_epochs if trainer.max_epochs is not None else -1
        return bool(trainer.is_last_batch) and trainer.current_epoch + 1 >= max_epochs > 0

    @staticmethod
    def _cadence_saves(trainer) -> bool:
        for c in trainer.callbacks:
            n = getattr(c, "_every_n_train_steps", 0) if isinstance(c, ModelCheckpoint) else 0
            if n and trainer.global_step % n == 0 and c.save_last:
                return True
        return False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.fast_dev_run or not self._final_step(trainer) or self._cadence_saves(trainer):
            return
        path = checkpoint_dir(trainer) / self.filename
        trainer.save_checkpoint(str(path))
        rank_zero_info(f"saved {path} at the final step {trainer.global_step}")


class PreemptionCheckpoint(Callback):
    """Save-and-stop on SIGTERM/SIGUSR1 at the next step boundary."""

    def __init__(self, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"), requeue: bool = True,
                 filename: str = "last.ckpt") -> None:
        self.signals = tuple(signals)
        self.requeue = requeue
        self.filename = filename
        self.pending: int | None = None
        self._previous: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal API
        self.pending = signum

    def on_train_start(self, trainer, pl_module) -> None:
        # Installed after Lightning's own connector, so these handlers take precedence.
        for name in self.signals:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handler)

    def on_train_end(self, trainer, pl_module) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Decide together under DDP: one rank's signal stops every rank at the same step.
        flag = trainer.strategy.reduce_boolean_decision(self.pending is not None, all=False)
        if not flag:
            return
        signum = self.pending or signal.SIGTERM
        path = checkpoint_dir(trainer) / self.filename
        trainer.save_checkpoint(str(path))
        name = signal.Signals(signum).name
        rank_zero_info(f"{name} received: saved {path} at step {trainer.global_step}; stopping "
                       "(resume with ckpt_path=last)")
        trainer.should_stop = True
        job = os.environ.get("SLURM_JOB_ID")
        if signum == signal.SIGUSR1 and self.requeue and job and trainer.is_global_zero:
            subprocess.run(["scontrol", "requeue", job], check=False)
        self.pending = None
