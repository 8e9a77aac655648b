"""Helpers for training tests: synthetic shards and in-process Hydra runs of train.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

import dflash_lit.resolvers  # noqa: F401
from dflash_lit.train.run import compose_train  # noqa: F401  (imported from here by the tests)

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


def make_shards(out: Path, n: int = 24, vocab: int = 128, seed: int = 0, lo: int = 48,
                hi: int = 96, max_stride: int = 3) -> Path:
    """Learnable synthetic rows: a short prompt, then an arithmetic progression mod (vocab-4)."""
    from dflash_lit.data.shards import write_shards

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(lo, hi))
        p = int(rng.integers(4, 9))
        start, stride = int(rng.integers(0, vocab - 4)), int(rng.integers(1, max_stride + 1))
        toks = [4 + (start + stride * t) % (vocab - 4) for t in range(length)]
        rows.append({"id": f"row{i}", "source": "synthetic", "input_ids": toks,
                     "loss_mask": [0] * p + [1] * (length - p)})
    write_shards(rows, out, rows_per_shard=8)
    return out


def base_overrides(tmp: Path, data: Path, val: Path | None = None) -> list[str]:
    ov = [
        "target=random_qwen3",
        "budget=full",  # recipe anchor counts as written (no tiny-data scaling)
        f"data.path={data}",
        f"data.val_path={val}" if val else "data.val_path=null",
        "data.max_length=128",
        "data.token_budget=512",
        "data.num_buckets=2",
        "drafter.head_dim=16",
        "drafter.intermediate_size=96",
        "drafter.block_size=8",
        "loss.gamma=4.0",
        "schedule.anchors.max=8",
        "val_max_anchors=8",
        "logger=csv",
        "callbacks=minimal",
        "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1",
        # fp32 everywhere: the default precision is measured per machine (bf16-mixed on CPUs
        # with fast bf16) and these tests compare runs to fp32 tolerances
        "trainer.precision=32-true",
        f"paths.log_dir={tmp}/outputs",
    ]
    return ov


def run_train(overrides: list[str], run_dir: Path):
    """Run train(cfg) in-process; returns (monitor value, cfg)."""
    from dflash_lit.train.run import train

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = compose_train(overrides, run_dir)
    # Hydra writes .hydra/overrides.yaml for real runs; the `last` lookup reads it.
    (run_dir / ".hydra").mkdir(exist_ok=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {o}\n" for o in overrides)
    )
    value = train(cfg)
    return value, cfg


def drafter_state(ckpt: Path) -> dict[str, torch.Tensor]:
    sd = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in sd.items() if k.startswith("drafters.")}


class RankRecorder(Callback):
    """Test callback (loaded by config: ``+callbacks.rec._target_=train_utils.RankRecorder``):
    per rank, records the (epoch, dataset row) pairs it trained on, a digest of its final
    drafter weights and the synced validation metrics in ``<out>/rank<r>.json``; it can also
    raise on one rank at one step (``fail_rank``, ``fail_step``) to test failure handling."""

    def __init__(self, out: str, fail_rank: int = -1, fail_step: int = -1) -> None:
        self.out, self.fail_rank, self.fail_step = out, fail_rank, fail_step
        self.rows: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.fail_rank and trainer.global_step == self.fail_step:
            raise RuntimeError(f"injected failure on rank {trainer.global_rank}")
        self.rows += [[trainer.current_epoch, int(i)] for i in batch["index"].tolist()]

    def on_train_end(self, trainer, pl_module) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        Path(self.out).mkdir(parents=True, exist_ok=True)
        (Path(self.out) / f"rank{trainer.global_rank}.json").write_text(
            json.dumps({"rows": self.rows, "digest": weights_digest(pl_module.drafters),
                        "val": metrics}))


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict (names and bytes)."""
    h = hashlib.sha256()
    for k, v in sorted(state.items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 over a module's state_dict."""
    return state_digest(module.state_dict())


class NonFiniteInjector(Callback):
    """Test callback: the target's embeddings turn NaN on the batches whose global step is in
    ``steps`` (a real forward hook, so the target's hidden states and logits are non-finite);
    after every batch it appends ``{step, poisoned, digest}`` of the drafters to ``out``."""

    def __init__(self, steps: list[int], out: str) -> None:
        self.steps, self.out = {int(s) for s in steps}, Path(out)
        self._hook = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step
        if self._step in self.steps:
            self._hook = pl_module._target.embed_tokens.register_forward_hook(
                lambda mod, args, out: out * float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        rec = {"step": self._step, "poisoned": self._step in self.steps,
               "digest": weights_digest(pl_module.drafters)}
        with self.out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
