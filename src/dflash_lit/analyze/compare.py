"""Several runs side by side: which metrics they share, which each lacks, curves aligned by
step and by tokens seen."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dflash_lit.analyze.logs import Run
from dflash_lit.analyze.stats import default_window, smooth

TOKENS = "train/tokens_seen"
KEY_LEAVES = ("loss", "acc", "streak")


@dataclass
class Comparison:
    runs: list[str]
    shared: list[str]  # metric columns every run logged
    missing: dict[str, list[str]]  # run -> metrics some other run has and it lacks
    x_tokens: dict[str, bool]  # run -> aligned by tokens seen (False: fell back to step)
    finals: list[dict] = field(default_factory=list)  # one row per (run, drafter)


def compare_runs(runs: list[Run]) -> Comparison:
    """Shared and missing metric names, and the final smoothed loss/acc/streak per drafter."""
    names = _unique_names(runs)
    sets = {n: set(r.metrics) for n, r in zip(names, runs)}
    union = set().union(*sets.values()) if sets else set()
    shared = sorted(set.intersection(*sets.values())) if sets else []
    missing = {n: sorted(union - s) for n, s in sets.items()}
    x_tokens = {n: bool(len(r.series(TOKENS)[0])) for n, r in zip(names, runs)}
    finals = []
    for n, r in zip(names, runs):
        s_tok, v_tok = r.series(TOKENS)
        for d in r.drafters:
            row = {"run": n, "drafter": d, "last_step": r.last_step,
                   "tokens_seen": float(v_tok[-1]) if len(v_tok) else None}
            for leaf in KEY_LEAVES:
                s, v = r.series(f"train/{d}/{leaf}")
                row[f"train_{leaf}"] = float(smooth(v, default_window(len(v)))[-1]) \
                    if len(v) else None
                vs, vv = r.series(f"val/{d}/{leaf}")
                row[f"val_{leaf}"] = float(vv[-1]) if len(vv) else None
            finals.append(row)
    return Comparison(runs=names, shared=shared, missing=missing, x_tokens=x_tokens,
                      finals=finals)


def _unique_names(runs: list[Run]) -> list[str]:
    out = []
    for r in runs:
        n, i = r.name, 2
        while n in out:
            n, i = f"{r.name} ({i})", i + 1
        out.append(n)
    return out


def aligned(run: Run, column: str, by: str = "step") -> tuple[np.ndarray, np.ndarray]:
    """(x, values) of ``column`` with x = step or tokens seen at that step (``by="tokens"``;
    falls back to step when tokens were not logged)."""
    s, v = run.series(column)
    if by != "tokens":
        return s.astype(float), v
    ts, tv = run.series(TOKENS)
    if len(ts) == 0:
        return s.astype(float), v
    x = np.interp(s, ts, tv)  # tokens are logged every step; interp covers val-only steps
    return x, v
