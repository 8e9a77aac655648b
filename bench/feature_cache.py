"""Cached target features: what the cache costs to build and what it saves per epoch, on the
embedded default (tiny target, default data), in one run.

- ``build``: wall seconds to run the target once over every train row and write the cache
  (into a fresh temporary directory), its size on disk;
- ``online`` / ``cache``: median seconds per training step of the default experiment
  (``bench/steps.py`` phases) with the target run per batch vs the features read from the
  cache; their ratio is the cost of an epoch after the first from the cache relative to an
  online epoch.

    python bench/feature_cache.py [--steps 6] [--overrides experiment=v5_hardce ...]
    python bench/feature_cache.py --name feature_cache_smollm2 --skip-build --overrides \
        experiment=v5_hardce target=smollm2 data=smollm2 drafter=smollm2 budget=smollm2_cpu

``--skip-build`` times the steps only (the cache a training run built is reused; its build
time is in that cache's ``manifest.json``).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from common import compose_train, fmt_table, peaks, write_result
from steps import PHASES, time_steps

from dflash_lit.train.build import build_specs, build_target, target_info
from dflash_lit.train.feature_cache import build_cache, split_fingerprint
from dflash_lit.train.spec import capture_layer_ids


def build_seconds(overrides: list[str]) -> dict:
    import hydra

    cfg = compose_train(overrides)
    info = target_info(cfg.target)
    specs = build_specs(cfg, info)
    dm = hydra.utils.instantiate(cfg.data, vocab_size=info["vocab_size"],
                                 block_size=max(s.model.block_size for s in specs), seed=0)
    dm.setup("fit")
    capture = capture_layer_ids(specs)
    target = build_target(cfg.target, capture)
    tmp = Path(tempfile.mkdtemp())
    try:
        fp = split_fingerprint(cfg, cfg.data.path, capture, 0)
        t0 = time.perf_counter()
        build_cache(target, dm.train_dataset, tmp / "c", fp, 8192, 0)
        secs = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in (tmp / "c").glob("*"))
    finally:
        shutil.rmtree(tmp)
    return {"rows": len(dm.train_dataset), "build_s": secs, "cache_mib": size / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--overrides", nargs="*", default=["experiment=v5_hardce"])
    ap.add_argument("--skip-build", action="store_true", help="time the steps only")
    ap.add_argument("--name", default="feature_cache", help="bench/results/<name>.{json,md}")
    args = ap.parse_args()
    ov = list(args.overrides)
    b = None if args.skip_build else build_seconds(ov + ["features=cache"])
    on = time_steps(ov + ["features=online"], steps=args.steps)
    ca = time_steps(ov + ["features=cache"], steps=args.steps)
    rows = [{"features": name, "step_s": m["step_s"],
             **{f"{p}_s": m[p] for p in PHASES}} for name, m in (("online", on), ("cache", ca))]
    ratio = ca["step_s"] / on["step_s"]
    table = fmt_table(rows) + f"\n\ncache epoch / online epoch: **{ratio:.2f}**" + (
        f"; build: {b['rows']} rows in {b['build_s']:.1f} s, {b['cache_mib']:.0f} MiB on disk "
        "(bf16)" if b else "") + f"; overrides: {' '.join(ov)}"
    write_result(args.name, {"peaks": peaks(), "build": b, "rows": rows,
                                   "epoch_ratio": ratio, "overrides": ov}, table)


if __name__ == "__main__":
    main()
