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
    """Write ``last.ckpt`` when training ends at a step no checkpoint was saved at.

    Lightning saves on its cadences only (every N steps / epochs), so a run stopped by
    ``max_steps`` between them would leave ``last.ckpt`` behind its final weights.
    """

    def __init__(self, filename: str = "last.ckpt") -> None:
        self.filename = filename

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.fast_dev_run or trainer.sanity_checking:
            return
        saved = {getattr(c, "_last_global_step_saved", -1) for c in trainer.callbacks
                 if isinstance(c, ModelCheckpoint)}
        if trainer.global_step in saved or trainer.global_step == 0:
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
