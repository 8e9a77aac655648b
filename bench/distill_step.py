"""Distillation-loss training step: the fused lm_head + forward KL (``train/linear_distill.py``)
against the materialised path it replaced, on the real module of the v3/v4 recipes.

One step = drafter forward on the batch's target features (``features=cache`` with the
target's top-64 logits, as the default budget trains), loss, backward; no optimizer, no
target forward. The materialised path is the one validation takes when it needs the logits
(``need_logits=True``): ``[B, N, Bs, V]`` drafter logits, the target's logits gathered to the
same shape, and the loss over valid slots in autograd. Both paths run on the same batches,
interleaved, in one process, at the precision ``trainer.precision`` resolves to here.

    python bench/distill_step.py [--recipes v3_composite v4_5layer] [--steps 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from common import compose_train, fmt_table, write_result

from dflash_lit.train.run import build_run


def _autocast(precision: str):
    if precision.startswith("bf16"):
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def time_recipe(recipe: str, steps: int) -> dict:
    """Median seconds per step of each path, over the same ``steps`` batches."""
    cfg = compose_train([f"experiment={recipe}"])
    precision = str(cfg.trainer.precision)
    module, dm, _ = build_run(cfg)
    module.train()
    module.schedules_at(0)
    it = iter(dm.train_dataloader())
    batches = [next(it) for _ in range(steps + 1)]  # the first one warms both paths up

    def step(batch, need_logits: bool) -> None:
        with _autocast(precision):
            out = module.target_features(batch)
            loss = sum(lo.loss for _, lo in module.drafter_losses(
                batch, out, 0, materialise=need_logits).values())
        loss.backward()
        module.drafters.zero_grad(set_to_none=True)

    times: dict[bool, list[float]] = {True: [], False: []}
    for i, batch in enumerate(batches):
        for need_logits in (True, False):
            t0 = time.perf_counter()
            step(batch, need_logits)
            if i:
                times[need_logits].append(time.perf_counter() - t0)
    mat, fused = statistics.median(times[True]), statistics.median(times[False])
    return {"recipe": recipe, "precision": precision, "materialised_s": mat,
            "fused_s": fused, "speedup": mat / fused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["v3_composite", "v4_5layer"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [time_recipe(r, args.steps) for r in args.recipes]
    table = fmt_table(rows) + (
        f"\n\nmedian s per step (drafter forward + loss + backward on cached features) over "
        f"{args.steps} batches, both paths on the same batches; {args.threads} thread(s)")
    write_result("distill_step", {"rows": rows, "steps": args.steps,
                                  "threads": args.threads}, table)


if __name__ == "__main__":
    main()
