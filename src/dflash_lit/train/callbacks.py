"""Training callbacks: throughput monitor and a one-line console status per log interval."""

from __future__ import annotations

import time

import lightning as L
from lightning.pytorch.callbacks import Callback


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}T"


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):  # NaN / unknown
        return "?"
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400 * 2:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


class ThroughputMonitor(Callback):
    """Logs target tokens/s, drafter block tokens/s and padding efficiency.

    Rates are smoothed with an EMA over steps; padding efficiency is cumulative over the run
    (real tokens / padded tokens), the number the bucketing sampler is judged by, and
    ``perf/epoch_padding_eff`` is the current epoch's planned figure from the datamodule.
    """

    def __init__(self, ema: float = 0.9) -> None:
        self.ema = ema
        self._t0: float | None = None
        self.tok_s = 0.0
        self.block_tok_s = 0.0
        self.real = 0.0
        self.padded = 0.0
        self.epoch_padding_eff: float | None = None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # the sampler's planned batches for this epoch (all ranks): known before any step
        dm = getattr(trainer, "datamodule", None)
        try:
            self.epoch_padding_eff = float(dm.padding_efficiency) if dm is not None else None
        except (AttributeError, TypeError):
            self.epoch_padding_eff = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._t0 is None:
            return
        dt = max(time.perf_counter() - self._t0, 1e-9)
        st = getattr(pl_module, "last_batch_stats", {}) or {}
        if not st:
            return
        tok, blk = st["target_tokens"] / dt, st["block_tokens"] / dt
        first = self.tok_s == 0.0
        self.tok_s = tok if first else self.ema * self.tok_s + (1 - self.ema) * tok
        self.block_tok_s = blk if first else self.ema * self.block_tok_s + (1 - self.ema) * blk
        self.real += st["target_tokens"]
        self.padded += st["padded_tokens"]
        vals = {
            "perf/target_tok_s": self.tok_s,
            "perf/block_tok_s": self.block_tok_s,
            "perf/padding_eff": self.real / max(self.padded, 1.0),
            "perf/step_s": dt,
        }
        if self.epoch_padding_eff is not None:
            vals["perf/epoch_padding_eff"] = self.epoch_padding_eff
        pl_module.log_dict(vals, on_step=True, on_epoch=False)


class StatusLine(Callback):
    """``[23m] step=661 loss=3.3144 acc=0.029 streak=0.0 lr=4.26e-04 noise=0.0354 | 21.4Ktok/s
    | epoch~0.02 ETA=6.0d`` every ``every_n_steps`` (default: the trainer's log interval)."""

    def __init__(self, every_n_steps: int | None = None) -> None:
        self.every = every_n_steps
        self._start = time.time()
        self._start_step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.time()
        self._start_step = trainer.global_step

    def format_line(self, trainer: L.Trainer, pl_module) -> str:
        m = trainer.callback_metrics
        name = next(iter(pl_module.drafters))
        step = trainer.global_step
        elapsed = time.time() - self._start

        def get(key: str, default=float("nan")) -> float:
            v = m.get(key)
            return float(v) if v is not None else default

        total = max(getattr(pl_module, "total_steps", 0), 1)
        done = step - self._start_step
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - step) / rate if rate > 0 else float("inf")
        nb = trainer.num_training_batches
        epoch = step / nb if isinstance(nb, int | float) and 0 < nb < float("inf") else 0.0
        tp = next((c for c in trainer.callbacks if isinstance(c, ThroughputMonitor)), None)
        tok = f" | {_human(tp.tok_s)}tok/s" if tp and tp.tok_s else ""
        extra = ""
        if len(pl_module.drafters) > 1:
            extra = " [" + " ".join(
                f"{n}:{get(f'train/{n}/acc'):.3f}" for n in pl_module.drafters) + "]"
        tau = get(f"val/{name}/tau_chain")
        if tau == tau:  # logged by the real-τ callback
            extra += f" tau={tau:.2f} ({get(f'val/{name}/tau_chain_vs_model_free'):.2f}x model-free)"
        plateau = sorted(getattr(pl_module, "plateau_warnings", {}))
        if plateau:
            extra += f" PLATEAU:{','.join(plateau)}"
        return (
            f"[{_duration(elapsed)}] step={step} loss={get(f'train/{name}/loss'):.4f} "
            f"acc={get(f'train/{name}/acc'):.3f} streak={get(f'train/{name}/streak'):.2f} "
            f"lr={get(f'train/{name}/lr'):.2e} noise={get(f'train/{name}/noise'):.4f}{extra}"
            f"{tok} | epoch~{epoch:.2f} ETA={_duration(eta)}"
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        every = self.every or max(int(trainer.log_every_n_steps), 1)
        if trainer.global_step % every or not trainer.is_global_zero:
            return
        line = self.format_line(trainer, pl_module)
        bar = trainer.progress_bar_callback
        if bar is not None and hasattr(bar, "print"):
            bar.print(line)
        else:
            print(line, flush=True)
