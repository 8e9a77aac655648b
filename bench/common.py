"""Shared bench helpers: machine info, matmul peak, timing, config composition, result files.

Every bench script measures this machine's matmul peak in the same run and reports its
figures as ratios (to a baseline measured alongside, and to that peak): shared machines are
noisy, absolute seconds are not comparable across runs.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash_lit.machine import cpu_name

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def machine_info() -> dict[str, Any]:
    """CPU model, cores, threads and library versions: the header of every result file."""
    return {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "command": portable(" ".join([Path(sys.argv[0]).name, *sys.argv[1:]])),
    }


def portable(text: str) -> str:
    """``text`` without this machine's paths: the repo root dropped, the Python prefix (where
    libraries such as ``lib/libiomp5.so`` live) written as ``<python prefix>``."""
    return text.replace(f"{REPO}{os.sep}", "").replace(sys.prefix, "<python prefix>")


def median_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_peak(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 5,
                device: str = "cpu") -> float:
    """Achieved GFLOP/s of an n×n @ n×n matmul (2n³ FLOPs), median of ``repeats``."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t = median_time(lambda: a @ b, repeats=repeats, warmup=2)
    return 2 * n**3 / t / 1e9


def peaks(n: int = 2048) -> dict[str, float]:
    """fp32 and bf16 matmul peaks (GFLOP/s) of this machine, measured now. Where bf16 is
    emulated (slower than fp32, see dflash_lit.precision) its peak is measured at n=512 so
    the probe takes seconds, not minutes."""
    from dflash_lit.precision import bf16_speedup

    n_bf16 = n if bf16_speedup() >= 1.0 else min(n, 512)
    return {"fp32_gflops": matmul_peak(torch.float32, n),
            "bf16_gflops": matmul_peak(torch.bfloat16, n_bf16)}


def compose_train(overrides: Sequence[str]):
    """The resolved train.py config for ``overrides``, run directory ``results/_scratch``."""
    from dflash_lit.train.run import compose_train as compose

    return compose(overrides, RESULTS / "_scratch")


def drafter_step_parts(cfg: Any, batch: int, seq: int, prompt_len: int, min_id: int):
    """A seeded drafter of shape ``cfg``, frozen random embed_tokens / lm_head of its vocab, and
    ``batch`` random rows of ``seq`` tokens (ids >= ``min_id``) whose first ``prompt_len`` are
    prompt: (drafter, embed, lm_head, ids, loss_mask, attention_mask)."""
    from dflash_lit import DFlashDrafter

    v, d = cfg.vocab_size, cfg.hidden_size
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    embed = torch.nn.Embedding(v, d).requires_grad_(False)
    lm_head = torch.nn.Linear(d, v, bias=False).requires_grad_(False)
    ids = torch.randint(min_id, v, (batch, seq))
    lm = torch.ones(batch, seq, dtype=torch.long)
    lm[:, :prompt_len] = 0
    am = torch.ones(batch, seq, dtype=torch.long)
    return drafter, embed, lm_head, ids, lm, am


def fmt_table(rows: list[dict[str, Any]], cols: Sequence[str] | None = None) -> str:
    """A markdown table of ``rows`` (floats to 4 significant digits)."""
    if not rows:
        return "(no rows)"
    cols = list(cols or rows[0].keys())

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def write_result(name: str, payload: dict[str, Any], table: str, results: Path = RESULTS) -> Path:
    """Print ``table`` and write ``<results>/<name>.json`` (+ ``.md`` with the table)."""
    results.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_info(), **payload}
    path = results / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    md = f"<!-- {payload['machine']['date']} · {payload['machine']['cpu']} · " \
         f"{payload['machine']['command']} -->\n{table}\n"
    (results / f"{name}.md").write_text(md)
    print(table)
    print(f"\nwrote {path}")
    return path
