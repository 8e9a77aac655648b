"""Resume cost: seconds from launch to the first training step, fresh vs ``ckpt_path=...``
(the difference is what a resume costs), and the checkpoint's size split into drafter
weights / optimizer state / everything else.

    python bench/resume_cost.py [--overrides experiment=v5_hardce ...]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import REPO, fmt_table, write_result
from lightning.pytorch.callbacks import Callback


class FirstStepTimer(Callback):
    """Prints the wall clock at the first training batch (read by this script)."""

    def __init__(self) -> None:
        self.done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.done:
            print(f"FIRST_STEP_AT {time.time():.4f}", flush=True)
            self.done = True


def launch_to_first_step(args: list[str], cwd: Path) -> float:
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO / "bench"))
    t0 = time.time()
    out = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env,
                         capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("FIRST_STEP_AT"))
    return float(line.split()[1]) - t0


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(nbytes(v) for v in obj)
    return 0


def size_split(ckpt: Path) -> dict[str, float]:
    c = torch.load(ckpt, map_location="cpu", weights_only=True)
    weights = sum(nbytes(v) for k, v in c["state_dict"].items() if k.startswith("drafters."))
    optim = nbytes(c.get("optimizer_states", []))
    total = ckpt.stat().st_size
    rest = {k: v for k, v in c.items() if k not in ("state_dict", "optimizer_states")}
    buf = io.BytesIO()
    torch.save(rest, buf)
    return {"file_MB": total / 1e6, "weights_MB": weights / 1e6, "optimizer_MB": optim / 1e6,
            "other_MB": (total - weights - optim) / 1e6, "other_pickled_MB": buf.tell() / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--overrides", nargs="*", default=["experiment=v5_hardce"])
    ap.add_argument("--repeats", type=int, default=3, help="alternating fresh/resume launches")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = [*args.overrides, "logger=csv", "callbacks=minimal", "trainer.limit_val_batches=0",
                f"paths.log_dir={tmp}/outputs", "+callbacks.timer._target_=resume_cost.FirstStepTimer"]
        fresh_t, resume_t = [], []
        fresh_t.append(launch_to_first_step(base + ["trainer.max_steps=2"], Path(tmp)))
        ckpt = next(Path(tmp).glob("outputs/*/*/checkpoints/last.ckpt"))
        for i in range(args.repeats):
            resume_t.append(launch_to_first_step(
                base + ["trainer.max_steps=3", f"ckpt_path={ckpt}"], Path(tmp)))
            if i + 1 < args.repeats:
                fresh_t.append(launch_to_first_step(base + ["trainer.max_steps=2"], Path(tmp)))
        fresh, resumed = sorted(fresh_t)[len(fresh_t) // 2], sorted(resume_t)[len(resume_t) // 2]
        sizes = size_split(ckpt)
    row = {"launch_to_first_step_fresh_s": fresh, "launch_to_first_step_resume_s": resumed,
           "resume_overhead_s": resumed - fresh, **sizes}
    write_result("resume_cost", {"rows": [row], "overrides": args.overrides}, fmt_table([row]))


if __name__ == "__main__":
    main()
