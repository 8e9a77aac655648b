"""Target features built by vLLM (``features=vllm``) against the HF forward (``features=cache``),
in one run: equality and build speed, and optionally the same training from both.

- ``hf`` / ``vllm``: wall seconds to build the train split's cache (float32 storage, no top-k)
  and rows/s; for vLLM also the engine's start-up, and rows/s once it is up;
- equality: the largest absolute difference of any stored feature, per captured layer, and
  how often the greedy ids agree;
- ``--train``: ``python train.py <overrides>`` three times, same seed: features=cache,
  features=vllm (bf16 storage, as users run it) and features=cache again from a cache the HF
  forward built in smaller batches (the same features up to float rounding: the spread any
  change of arithmetic order gives). For each pair the largest relative difference of the
  training loss at any logged step, and of its moving average over ``--window`` steps.

    python bench/vllm_features.py --train                      # tiny default (v5_hardce)
    python bench/vllm_features.py --train --no-builds --name vllm_features_tiny_spread
    python bench/vllm_features.py --name vllm_features_smollm2 --rows 200 --overrides \
        experiment=v5_hardce target=smollm2 data=smollm2 drafter=smollm2 budget=smollm2_cpu

With ``--rows N`` the training runs use the first N train rows too (a shard copy of them).
"""

from __future__ import annotations

import argparse
import csv
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import compose_train, fmt_table, peaks, write_result
from omegaconf import open_dict

from dflash_lit.data.features import FeatureStore, to_tensor
from dflash_lit.data.vllm_features.build import build_cache_vllm, engine_fingerprint
from dflash_lit.train.build import build_specs, build_target, target_info
from dflash_lit.train.feature_cache import build_cache, split_fingerprint
from dflash_lit.train.spec import capture_layer_ids

ROOT = Path(__file__).resolve().parents[1]


def builds(overrides: list[str], rows: int | None, eager: bool) -> dict:
    import hydra

    cfg = compose_train(overrides + ["features=vllm", "features.dtype=float32"])
    if eager:
        with open_dict(cfg):
            cfg.features.engine.enforce_eager = True
    info = target_info(cfg.target)
    specs = build_specs(cfg, info)
    dm = hydra.utils.instantiate(cfg.data, vocab_size=info["vocab_size"],
                                 block_size=max(s.model.block_size for s in specs), seed=0)
    dm.setup("fit")
    ds = dm.train_dataset if rows is None else dm.train_dataset.subset(np.arange(rows))
    capture = capture_layer_ids(specs)
    tmp = Path(tempfile.mkdtemp())
    try:
        fp = split_fingerprint(cfg, cfg.data.path, capture, 0)
        t0 = time.perf_counter()
        build_cache(build_target(cfg.target, capture), ds, tmp / "hf", fp, 8192, 0)
        hf_s = time.perf_counter() - t0
        fpv = {**fp, "engine": engine_fingerprint(cfg.features.engine, str(cfg.target.dtype))}
        t0 = time.perf_counter()
        build_cache_vllm(cfg, ds, tmp / "vllm", fpv, 0, capture, info["num_layers"],
                         info["hidden_size"])
        vl_s = time.perf_counter() - t0
        a, b = FeatureStore(tmp / "hf"), FeatureStore(tmp / "vllm")
        d = info["hidden_size"]
        per_layer = np.zeros(len(capture))
        agree = total = 0
        for r, n in a._lengths.items():
            diff = (to_tensor(a.hidden(r, n)) - to_tensor(b.hidden(r, n))).abs()
            per_layer = np.maximum(per_layer, diff.view(n, len(capture), d).amax((0, 2)).numpy())
            agree += int((a.argmax(r, n) == b.argmax(r, n)).sum())
            total += n
        startup = float(b.manifest.get("engine_startup_s", 0.0))
    finally:
        shutil.rmtree(tmp)
    return {"rows": len(ds), "tokens": int(ds.lengths.sum()), "layer_ids": capture,
            "hf_build_s": hf_s, "vllm_build_s": vl_s, "vllm_startup_s": startup,
            "hf_rows_per_s": len(ds) / hf_s, "vllm_rows_per_s": len(ds) / vl_s,
            "vllm_rows_per_s_running": len(ds) / max(vl_s - startup, 1e-9),
            "max_abs_diff": float(per_layer.max()),
            "max_abs_diff_per_layer": per_layer.tolist(), "argmax_agreement": agree / total}


def subset_shards(cfg_path: str, rows: int, out: Path) -> Path:
    """The first ``rows`` rows of the train shards at ``cfg_path``, as one Parquet shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_lit.data.shards import find_shards

    tables, n = [], 0
    for f in find_shards(cfg_path):
        t = pq.read_table(f)
        tables.append(t.slice(0, rows - n))
        n += tables[-1].num_rows
        if n >= rows:
            break
    out.mkdir(parents=True)
    pq.write_table(pa.concat_tables(tables), out / "shard-00000.parquet")
    return out


def train_losses(overrides: list[str], features: str, run_dir: Path, log_dir: Path,
                 extra: tuple[str, ...] = ()) -> dict[int, float]:
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"features={features}",
           "logger=csv", f"paths.log_dir={log_dir}", f"hydra.run.dir={run_dir}", *extra]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(run_dir / "csv" / "metrics.csv") as f:
        key = "train/main/loss"
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}


def spread(a: dict[int, float], b: dict[int, float], window: int) -> dict:
    """Largest relative loss difference of ``b`` against ``a``: per logged step, and of the
    trailing moving average over ``window`` logged steps."""
    steps = sorted(set(a) & set(b))
    x = np.array([a[s] for s in steps])
    y = np.array([b[s] for s in steps])
    rel = np.abs(x - y) / np.abs(x)
    k = np.ones(window) / window
    xs, ys = np.convolve(x, k, "valid"), np.convolve(y, k, "valid")
    rel_s = np.abs(xs - ys) / np.abs(xs)
    i, j = int(rel.argmax()), int(rel_s.argmax())
    return {"steps": len(steps), "max_rel_diff": float(rel[i]), "at_step": steps[i],
            "mean_rel_diff": float(rel.mean()), "max_rel_diff_smoothed": float(rel_s[j]),
            "smoothed_at_step": steps[j + window - 1], "final_loss_a": float(x[-1]),
            "final_loss_b": float(y[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--overrides", nargs="*", default=["experiment=v5_hardce"])
    ap.add_argument("--rows", type=int, default=None, help="first N train rows (default all)")
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    ap.add_argument("--train", action="store_true", help="also train from both caches")
    ap.add_argument("--no-builds", action="store_true", help="skip the build/equality part")
    ap.add_argument("--window", type=int, default=50, help="moving-average window (steps)")
    ap.add_argument("--rebatch-tokens", type=int, default=2048,
                    help="features.batch_tokens of the re-batched HF cache")
    ap.add_argument("--name", default="vllm_features_tiny", help="bench/results/<name>.*")
    args = ap.parse_args()
    ov = list(args.overrides)
    payload: dict = {"peaks": peaks(), "overrides": ov}
    table = ""
    if not args.no_builds:
        b = builds(ov, args.rows, args.eager)
        rows = [{"build": "hf forward", "seconds": b["hf_build_s"], "rows/s": b["hf_rows_per_s"]},
                {"build": "vLLM (with start-up)", "seconds": b["vllm_build_s"],
                 "rows/s": b["vllm_rows_per_s"]},
                {"build": "vLLM (running)", "seconds": b["vllm_build_s"] - b["vllm_startup_s"],
                 "rows/s": b["vllm_rows_per_s_running"]}]
        table = fmt_table(rows) + (
            f"\n\n{b['rows']} rows, {b['tokens']} tokens; layer ids {b['layer_ids']}; max |vLLM - "
            f"HF| {b['max_abs_diff']:.2e} (per captured layer "
            f"{', '.join(f'{x:.1e}' for x in b['max_abs_diff_per_layer'])}); greedy ids agree on "
            f"{100 * b['argmax_agreement']:.3f}% of positions; vLLM running / HF rows/s: "
            f"**{b['vllm_rows_per_s_running'] / b['hf_rows_per_s']:.2f}x**")
        payload["build"] = b
    if args.train:
        tmp = Path(tempfile.mkdtemp())
        try:
            if args.rows is not None:
                path = compose_train(ov).data.path
                ov = [*ov, f"data.path={subset_shards(path, args.rows, tmp / 'subset')}"]
            a = train_losses(ov, "cache", tmp / "cache", tmp / "out")
            v = train_losses(ov, "vllm", tmp / "vllm", tmp / "out")
            r = train_losses(ov, "cache", tmp / "rebatched", tmp / "out",
                             (f"features.batch_tokens={args.rebatch_tokens}",
                              f"features.dir={tmp / 'rebatched_features'}"))
        finally:
            shutil.rmtree(tmp)
        pairs = {"vllm vs hf cache": spread(a, v, args.window),
                 "hf re-batched vs hf cache": spread(a, r, args.window)}
        payload["train"] = pairs
        rows = [{"runs": k, "logged steps": p["steps"], "worst step": f"{100 * p['max_rel_diff']:.2f}% "
                 f"(step {p['at_step']})", "mean": f"{100 * p['mean_rel_diff']:.2f}%",
                 f"worst {args.window}-step average": f"{100 * p['max_rel_diff_smoothed']:.2f}%",
                 "final loss": f"{p['final_loss_a']:.4f} / {p['final_loss_b']:.4f}"}
                for k, p in pairs.items()]
        subset = f", first {args.rows} train rows" if args.rows is not None else ""
        table += (("\n\n" if table else "") + f"training ({' '.join(args.overrides)}{subset}, "
                  "bf16 storage, same seed; relative loss differences; re-batched = the HF forward at "
                  f"features.batch_tokens={args.rebatch_tokens}):\n\n" + fmt_table(rows))
    write_result(args.name, payload, table)


if __name__ == "__main__":
    main()
