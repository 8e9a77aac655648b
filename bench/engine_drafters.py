"""Drafters head to head in vLLM: several exported drafters and the engine's suffix decoding,
served in the same interleaved rounds, so that the ratios between them are paired.

Two separate ``evaluate.py engine=vllm vllm.repeats=3`` runs can disagree by ~30 % on the
same method's tokens/s (the machine drifts between them), which is wider than the difference
between two good drafters. Here every contestant runs once per round, each in a fresh engine,
the order rotating by one each round; ratios are taken within a round and summarised as the
median [min-max] over rounds.

    python bench/engine_drafters.py --jobs outputs/eval/RUN/engine_runs \
        --drafter shipped=artifacts/tiny/drafter --drafter new=outputs/eval/RUN/drafter

``--jobs`` is the ``engine_runs`` directory of an earlier ``evaluate.py engine=vllm`` run with
``chain`` and ``suffix`` among its methods: its ``chain_c1.job.json`` and ``suffix_c1.job.json``
give the target, prompts, dtype, token budget and engine settings, so the contestants are
served exactly as that evaluation served them. ``--engine-arg NAME:KEY=JSON`` gives one
contestant one more engine argument and ``--engine-env NAME:VAR=VALUE`` one more environment
variable (the same drafter twice, with and without it); ``--drafter NAME=suffix`` adds one more
suffix-decoding contestant, so a setting can be tried on both methods in the same rounds.
Every contestant's tokens must equal suffix decoding's (both lossless against the target's
greedy output). Engine runs already written under ``outputs/bench/<name>/`` are read back.
Writes ``bench/results/<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import REPO, fmt_table, machine_info, portable, write_result

from dflash_lit.eval.vllm_engine import paired_ratio, run_worker, summarize_engine
from dflash_lit.paths import repo_relative


def band(a: list[float], b: list[float]) -> str:
    """``a`` over ``b`` (tokens/s per round): the median [min-max] of the within-round ratios."""
    r = paired_ratio({"tokens_per_s_rounds": a}, {"tokens_per_s_rounds": b})
    return f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]"


def spread(xs: list[float]) -> str:
    """The median [min-max] of per-round values."""
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def served(job: dict, work: Path, name: str, timeout_s: float, env: dict[str, str]) -> dict:
    """One contestant's engine run (read back when ``work/<name>.result.json`` exists, so a
    killed comparison resumes at the run it lost)."""
    done = work / f"{name}.result.json"
    if done.is_file():
        return json.loads(done.read_text())
    return run_worker(job, work, name, timeout_s, True, env)


def assignments(specs: list[str], names: list[str], flag: str) -> dict[str, dict[str, str]]:
    """``["a:KEY=VALUE", ...]`` -> {"a": {"KEY": "VALUE"}}; one line naming the flag on a
    malformed item or an unknown contestant."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        name, _, kv = spec.partition(":")
        key, eq, value = kv.partition("=")
        if not (key and eq):
            raise SystemExit(f"{flag} {spec}: expected NAME:KEY=VALUE")
        if name not in names:
            raise SystemExit(f"{flag} {spec}: no contestant named {name} ({', '.join(names)})")
        out.setdefault(name, {})[key] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", required=True, type=Path, help="engine_runs/ of an evaluation")
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="NAME:KEY=JSON",
                    help="one more vllm.LLM argument for contestant NAME only, e.g. "
                         "shipped_sync:async_scheduling=false")
    ap.add_argument("--engine-env", action="append", default=[], metavar="NAME:VAR=VALUE",
                    help="one more environment variable for contestant NAME's engine, e.g. "
                         "shipped_iomp:LD_PRELOAD=/path/to/libiomp5.so")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--goal", type=float, default=1.2,
                    help="tokens/s over suffix decoding's that the 'tau for' column solves for")
    ap.add_argument("--name", default="engine_drafters_tiny")
    ap.add_argument("--timeout-s", type=float, default=1800)
    args = ap.parse_args()
    chain_job = json.loads((args.jobs / "chain_c1.job.json").read_text())
    suffix_job = json.loads((args.jobs / "suffix_c1.job.json").read_text())
    jobs = {}
    for spec in args.drafter:
        name, eq, path = spec.partition("=")
        if not (name and eq and path) or name == "suffix":
            raise SystemExit(f"--drafter {spec}: expected NAME=DIR (or NAME=suffix), NAME not "
                             "'suffix'")
        job = json.loads(json.dumps(suffix_job if path == "suffix" else chain_job))
        if path != "suffix":
            job["speculative_config"]["model"] = str(Path(path).resolve())
        jobs[name] = job
    jobs["suffix"] = suffix_job
    names = list(jobs)
    for name, kv in assignments(args.engine_arg, names, "--engine-arg").items():
        jobs[name]["llm_kwargs"].update({k: json.loads(v) for k, v in kv.items()})
    envs = assignments(args.engine_env, names, "--engine-env")
    work = REPO / "outputs" / "bench" / args.name
    rounds: list[dict[str, dict]] = []
    for k in range(args.rounds):
        order = names[k % len(names):] + names[:k % len(names)]
        rounds.append({n: served(jobs[n], work, f"{n}_r{k}", args.timeout_s, envs.get(n, {}))
                       for n in order})
    ref = [r["tokens"] for r in rounds[0]["suffix"]["requests"]]
    lossless = all([r["tokens"] for r in rd[n]["requests"]] == ref
                   for rd in rounds for n in names)
    summaries = {n: [summarize_engine(rd[n]) for rd in rounds] for n in names}
    tps = {n: [x["tokens_per_s"] for x in summaries[n]] for n in names}
    step_ms = {n: [1e3 * x["wall_time_s"] / x["steps"] for x in summaries[n]] for n in names}
    tau_suffix = summaries["suffix"][0]["tau"]
    rows = []
    for n in names:
        is_suffix = jobs[n]["speculative_config"]["method"] == "suffix"
        row = {"method": n if n == "suffix" else f"{'suffix' if is_suffix else 'dflash'} `{n}`",
               "tau": round(summaries[n][0]["tau"], 3),
               "tok/s per round": " / ".join(f"{x:.0f}" for x in tps[n]),
               "median tok/s": round(statistics.median(tps[n]), 1),
               "vs suffix": band(tps[n], tps["suffix"]),
               "ms/step": round(statistics.median(step_ms[n]), 2),
               # the τ at which this contestant's step cost would give --goal x suffix decoding's
               # tokens/s: goal x suffix's τ x (this step's time / suffix's), per round
               f"tau for {args.goal:g}x suffix": "-" if is_suffix else spread(
                   [args.goal * tau_suffix * a / b for a, b in zip(step_ms[n], step_ms["suffix"])])}
        for m in names[:-1]:
            row[f"vs {m}"] = "-" if m == n else band(tps[n], tps[m])
        rows.append(row)
    payload = {"machine": machine_info(), "rounds": args.rounds, "lossless": lossless,
               "jobs": repo_relative(str(args.jobs.resolve())),
               "drafters": {n: repo_relative(jobs[n]["speculative_config"]["model"])
                            for n in names if jobs[n]["speculative_config"]["method"] != "suffix"},
               "engine_args": args.engine_arg,
               "engine_env": [portable(e) for e in args.engine_env],
               "prompts": len(chain_job["prompts"]), "max_tokens": chain_job["max_tokens"],
               "dtype": chain_job["dtype"], "tokens_per_s": tps, "step_ms": step_ms,
               "rows": rows}
    table = fmt_table(rows) + (
        f"\n\nLossless (every output equal to suffix decoding's): {lossless}. ms/step: wall time "
        "over verify steps (median over rounds); 'tau for': the τ a drafter with that step time "
        f"needs for {args.goal:g}x suffix decoding's tokens/s, per round, median [min-max].")
    write_result(args.name, payload, table)
    print(table)


if __name__ == "__main__":
    main()
