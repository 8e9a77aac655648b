"""Time training steps phase by phase (data, target forward, drafter forward, backward,
optimizer) on the real module and datamodule of a composed train.py config."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from common import compose_train
from flops import drafter_train_flops, target_forward_flops

from dflash_lit.train.run import build_run

PHASES = ("data", "target_fwd", "drafter_fwd", "backward", "optimizer")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(overrides: Sequence[str], steps: int = 4, warmup: int = 1) -> dict:
    """Median seconds per phase over ``steps`` steps, tokens and analytic FLOPs per step."""
    cfg = compose_train(overrides)
    module, dm, total = build_run(cfg)
    opt = module.configure_optimizers()["optimizer"]
    module.train()
    it = iter(dm.train_dataloader())
    rows = []
    for i in range(warmup + steps):
        t = {}
        t0 = time.perf_counter()
        batch = next(it)
        t["data"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = module.target_features(batch)
        _sync()
        t["target_fwd"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        module.schedules_at(i)
        loss, flops, blocks = 0.0, 0.0, 0
        for name, (layout, lo) in module.drafter_losses(batch, out, i).items():
            loss = loss + lo.loss
            flops += drafter_train_flops(module.specs[name].model, layout)
            blocks += int(layout.valid.sum()) * layout.block_size
        _sync()
        t["drafter_fwd"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        loss.backward()
        _sync()
        t["backward"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        t["optimizer"] = time.perf_counter() - t0
        cached = "target_hidden" in batch  # features=cache: no target forward in the step
        tf = 0.0 if cached else target_forward_flops(module.target.model, batch["attention_mask"],
                                                     module.need_logits)
        if i >= warmup:
            rows.append({**t, "target_tokens": float(batch["attention_mask"].sum()),
                         "block_tokens": float(blocks), "drafter_flops": flops,
                         "target_flops": tf})
    med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}
    med["step_s"] = sum(med[p] for p in PHASES)
    med["drafter_params"] = float(sum(p.numel() for p in module.drafters.parameters()))
    med["target_params"] = float(sum(p.numel() for p in module.target.parameters()))
    return med
