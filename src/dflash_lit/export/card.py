"""The model card ``export.py`` writes next to a drafter: what it was trained for and on, how,
for how long, and what it does in the serving engine against the engine's model-free methods.

Training facts come from the run directory of a ``<run>/checkpoints/*.ckpt`` (Hydra's
``overrides.yaml``, ``config_resolved.yaml``, ``csv/metrics.csv``); engine results from an
``evaluate.py engine=vllm`` report. Paths inside the repository are written relative to it, so
a shipped card's commands work from any clone.
"""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path
from typing import Any

import yaml

from dflash_lit.errors import UserError
from dflash_lit.eval.report import vs_best_text
from dflash_lit.machine import describe
from dflash_lit.paths import repo_relative


def run_facts(ckpt: str | Path) -> dict[str, Any]:
    """What a training run directory records about the run that wrote ``ckpt`` ({} if none)."""
    run = Path(ckpt).resolve().parent.parent
    facts: dict[str, Any] = {}
    overrides = run / ".hydra" / "overrides.yaml"
    if overrides.is_file():
        args = [a for a in (yaml.safe_load(overrides.read_text()) or [])
                if not str(a).startswith("hydra.")]
        facts["command"] = "python train.py " + shlex.join(str(a) for a in args)  # paste-able
    resolved = run / "config_resolved.yaml"
    if resolved.is_file():
        cfg = yaml.safe_load(resolved.read_text()) or {}
        data = cfg.get("data") or {}
        facts["data"] = repo_relative(data.get("path"))
        facts["target"] = repo_relative((cfg.get("target") or {}).get("path"))
    metrics = run / "csv" / "metrics.csv"
    if metrics.is_file():
        step_s, tokens = 0.0, None
        with open(metrics, newline="") as f:
            for row in csv.DictReader(f):
                if row.get("perf/step_s"):
                    step_s += float(row["perf/step_s"])
                if row.get("train/tokens_seen"):
                    tokens = float(row["train/tokens_seen"])
        facts["train_seconds"] = step_s
        facts["tokens_seen"] = tokens
    return facts


def _engine_section(report: dict[str, Any], drafter_dir: str) -> str:
    eng = report["engine"]
    m = report["methods"]
    best = report.get("best_model_free")
    rows = []
    names = {"baseline": "plain (no speculation)", "chain": "**dflash (this drafter)**",
             "ngram": "ngram", "suffix": "suffix"}
    for k in ("baseline", "chain", "ngram", "suffix"):
        if k not in m:
            continue
        r = m[k]
        tau = "1" if k == "baseline" else f"{r['tau']:.2f}"
        vs = vs_best_text(report, k) if best and k != "baseline" else "-"
        rows.append(f"| {names[k]} | {tau} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {vs} |")
    p = report["prompts"]
    s = report["settings"]
    cfg = report.get("config") or {}
    cmd = (f"python evaluate.py engine=vllm ckpt={drafter_dir} prompts={p['set']}"
           + (f" limit={p['limit']}" if p.get("limit") else "")
           + f" max_new_tokens={s['max_new_tokens']} dtype={eng['dtype']}"
           + f" 'methods=[{','.join(k for k in m if k != 'baseline')}]'"
           + f" 'vllm.concurrency=[{','.join(str(c) for c in eng['concurrency'])}]'"
           + (f" vllm.repeats={eng['repeats']}" if eng.get("repeats", 1) > 1 else ""))
    if cfg.get("target"):
        cmd += f" target={repo_relative(cfg['target'])}"
    lossless = "yes" if report["lossless"] else f"NO ({len(report['mismatches'])} mismatches)"
    more = []
    for c, by in eng["concurrency"].items():
        if str(c) == str(eng["tokens_per_s_measured_at"]):
            continue
        cells = ", ".join(f"{names[k].strip('*')} {by[k]['tokens_per_s']:.1f} ({by[k]['speedup']:.2f}x)"
                          for k in ("chain", "ngram", "suffix", "baseline") if k in by)
        more.append(f"At {c} requests in flight, tokens/s (x plain): {cells}.")
    if more:
        rows.append("")
        rows.extend(more)
    reps = eng.get("repeats", 1)
    rounds = (f" ({reps} rounds, the methods interleaved: tokens/s and x plain are medians, "
              "\"vs\" the median [min-max] of the ratios within each round)" if reps > 1 else "")
    return f"""## In vLLM {eng['version']}

{report['num_prompts']} held-out prompts (`{p['set']}`) x {s['max_new_tokens']} new tokens, greedy,
{eng['dtype']}, one request at a time, each method in a fresh engine; {eng.get('machine') or describe()}.
τ = tokens per verify step (bonus included); "vs {best}" is against the engine's fastest
model-free method in the same run{rounds}.

| method | τ | tokens/s | x plain | vs {best} |
|---|---|---|---|---|
{chr(10).join(rows)}

Lossless (every output equal to vLLM's plain greedy output): {lossless}.
Reproduce: `{cmd}`
"""


def model_card(serve: str, info: dict[str, Any], facts: dict[str, Any],
               report: dict[str, Any] | None, drafter_dir: str) -> str:
    """The card: training facts, the engine results (when a report is given), then ``serve``
    (the serve instructions, whose first line is its own title)."""
    t = info.get("target") or {}
    target = repo_relative(facts.get("target") or t.get("path")) or "unrecorded"
    lines = [f"# DFlash drafter for `{target}`", ""]
    if report is not None:
        lines.append(_engine_section(report, drafter_dir))
    train = ["## Training", ""]
    train.append(f"- target: `{target}`")
    if facts.get("data"):
        train.append(f"- data: `{facts['data']}`")
    if facts.get("command"):
        train.append(f"- command: `{facts['command']}`")
    if info.get("global_step") is not None:
        train.append(f"- steps: {info['global_step']}"
                     + (f", {facts['tokens_seen'] / 1e6:.2f}M target tokens seen"
                        if facts.get("tokens_seen") else ""))
    if facts.get("train_seconds"):
        train.append(f"- training time: {facts['train_seconds'] / 60:.1f} min of optimizer steps "
                     "(sum of step times, validation excluded) on a CPU")
    if len(train) == 3:
        train.append("- not recorded (exported from a directory, not a training run)")
    lines += train + [""]
    lines.append(serve.replace("# DFlash drafter", "## Drafter", 1))
    return "\n".join(lines)


def load_report(path: str | Path | None) -> dict[str, Any] | None:
    """An ``evaluate.py engine=vllm`` report.json (None when no path)."""
    if not path:
        return None
    rep = json.loads(Path(path).read_text())
    if "engine" not in rep:
        raise UserError(f"card_report={path}: not an engine report (run evaluate.py engine=vllm)")
    return rep
