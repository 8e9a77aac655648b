"""``last.ckpt`` is always where the run stopped: on SIGTERM/SIGUSR1 and at the end of training.

Graceful preemption: SIGTERM / SIGUSR1 -> checkpoint at the next step boundary, clean exit.

SLURM sends SIGUSR1 (``#SBATCH --signal=SIGUSR1@90``) before the time limit and SIGTERM on
cancel/preemption. Either sets a flag; after the current optimizer step the callback writes
``last.ckpt`` (atomically, through the trainer's checkpoint IO) and stops the trainer, so
``ckpt_path=last`` continues bit-exactly. On SIGUSR1 inside a SLURM job with
``requeue=true`` it also runs ``scontrol requeue $SLURM_JOB_ID``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info


def checkpoint_dir(trainer) -> Path:
    """Where the run's ModelCheckpoint writes (``<run>/checkpoints`` without one)."""
    cb = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
    if cb is not None and cb.dirpath:
        return Path(cb.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


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
