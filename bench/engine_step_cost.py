"""Where a verify step's time goes in vLLM: the target's forward, the draft proposal, the rest.

Serves the same prompts greedily with each method (plain, the drafter's ``dflash``, ``suffix``)
in an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so one profiler sees the whole
step) under cProfile, and splits each engine step into the target model's forward
(``_model_forward``: the verify of the drafted tokens), the proposal of the next draft
(``propose_draft_token_ids``: the drafter's forward, or the suffix tree's lookup) and everything
else (scheduling, sampling, bookkeeping). The profiler slows Python-heavy parts more than
kernels: read the shares, and tokens/s from the unprofiled pass printed beside them.

    python bench/engine_step_cost.py                      # tiny target, shipped drafter
    python bench/engine_step_cost.py --limit 40 --max-new-tokens 128
    python bench/engine_step_cost.py --methods plain dflash --breakdown 15

``--breakdown N`` adds one more pass per speculative method that profiles only the draft
proposal and lists the N functions inside it with the most cumulative time (share of the
proposal's own time), to see which part of a proposal costs what.

Writes ``bench/results/<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, fmt_table, write_result

# (file suffix, function): what each part of an engine step is measured by
PARTS = {"target forward": ("gpu_model_runner.py", "_model_forward"),
         "draft proposal": ("gpu_model_runner.py", "propose_draft_token_ids"),
         "engine step": ("engine/core.py", "step")}


def spec_config(method: str, drafter: str, block: int) -> dict | None:
    if method == "dflash":
        return {"method": "dflash", "model": drafter, "num_speculative_tokens": block - 1}
    if method == "suffix":
        return {"method": "suffix"}
    return None


def worker(args: argparse.Namespace) -> None:
    """One method, one pass over the prompts, in this process (``--profile``: under cProfile).
    The warm-up uses prompts outside the measured ones: suffix decoding's cache learns from
    every output it served, so a prompt served twice would be drafted from its own answer."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    every = [json.loads(line)["prompt"] for line in open(args.prompts)]
    prompts, warm = every[: args.limit], every[args.limit:args.limit + 2]
    llm = LLM(model=args.target, dtype="float32", max_num_seqs=1, seed=0, max_model_len=2048,
              gpu_memory_utilization=0.15,
              speculative_config=spec_config(args.method, args.drafter, args.block))
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    llm.generate(warm, sp, use_tqdm=False)
    prof = cProfile.Profile()
    if args.breakdown_pass:  # profile the proposal alone (one profiler at a time in Python)
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        propose = GPUModelRunner.propose_draft_token_ids

        def profiled(self, *a, **kw):
            prof.enable()
            try:
                return propose(self, *a, **kw)
            finally:
                prof.disable()

        GPUModelRunner.propose_draft_token_ids = profiled
    if args.profile:
        prof.enable()
    t0, tokens = time.perf_counter(), 0
    for p in prompts:
        tokens += len(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids)
    wall = time.perf_counter() - t0
    prof.disable()
    out = {"tokens": tokens, "wall_s": wall}
    if args.profile:
        st = pstats.Stats(prof).stats  # {(file, line, func): (cc, ncalls, tottime, cumtime, ..)}
        for part, (suffix, func) in PARTS.items():
            hits = [(v[1], v[3]) for (f, _, fn), v in st.items()
                    if fn == func and f.endswith(suffix)]
            out[part] = {"calls": max((c for c, _ in hits), default=0),
                         "seconds": max((t for _, t in hits), default=0.0)}
    if args.breakdown_pass:
        out["breakdown"] = proposal_breakdown(pstats.Stats(prof).stats, args.breakdown_pass)
    Path(args.out).write_text(json.dumps(out))


def proposal_breakdown(st: dict, top: int) -> list[dict]:
    """The ``top`` functions by cumulative time in a profile of the draft proposal alone, as
    shares of the proposal's time (nested functions overlap: shares do not add up)."""
    total = max((v[3] for (f, _, fn), v in st.items() if fn == "propose_draft_token_ids"),
                default=0.0)
    rows = sorted(((v[3], v[1], f, line, fn) for (f, line, fn), v in st.items()
                   if fn != "propose_draft_token_ids"), reverse=True)
    import vllm

    vllm_root = os.path.dirname(vllm.__file__) + os.sep
    return [{"function": fn, "where": (f.removeprefix(vllm_root) if f.startswith(vllm_root)
                                       else os.path.basename(f)) + f":{line}",
             "calls": calls, "share": round(cum / total, 3) if total else None}
            for cum, calls, f, line, fn in rows[:top]]


def run_method(method: str, profile: bool, breakdown: int = 0) -> dict:
    """``worker`` in a fresh process (vLLM keeps global state; suffix decoding's cache starts
    empty)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--method", method,
                        "--out", f.name, *(["--profile"] if profile else []),
                        *(["--breakdown-pass", str(breakdown)] if breakdown else [])],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(Path(f.name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(REPO / "artifacts/tiny/target"))
    ap.add_argument("--drafter", default=str(REPO / "artifacts/tiny/drafter"))
    ap.add_argument("--block", type=int, default=16, help="the drafter's block size")
    ap.add_argument("--prompts", default=str(REPO / "artifacts/tiny/prompts/eval.jsonl"))
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["plain", "dflash", "suffix"])
    ap.add_argument("--name", default="engine_step_cost_tiny")
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--breakdown", type=int, default=0,
                    help="list the N costliest functions inside the draft proposal")
    ap.add_argument("--breakdown-pass", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.method:
        return worker(args)
    res = {}
    for m in args.methods:  # an unprofiled pass for tokens/s, a profiled one for the shares
        res[m] = {**run_method(m, True), "unprofiled": run_method(m, False)}
        if args.breakdown and m != "plain":
            res[m]["breakdown"] = run_method(m, False, args.breakdown)["breakdown"]
    plain_step = res["plain"]["engine step"]["seconds"] / res["plain"]["engine step"]["calls"] \
        if "plain" in res else None
    rows = []
    for m, r in res.items():
        steps = r["engine step"]["calls"]
        step = r["engine step"]["seconds"]
        fwd, prop = r["target forward"]["seconds"], r["draft proposal"]["seconds"]
        rows.append({"method": m,
                     "tokens/s (unprofiled)": r["unprofiled"]["tokens"] / r["unprofiled"]["wall_s"],
                     "engine steps": steps, "tokens/step": r["tokens"] / steps,
                     "step (x plain's)": (step / steps) / plain_step if plain_step else None,
                     "target forward": f"{100 * fwd / step:.0f}%",
                     "draft proposal": f"{100 * prop / step:.0f}%",
                     "rest": f"{100 * (step - fwd - prop) / step:.0f}%"})
    table = fmt_table(rows) + (
        f"\n\n{args.limit} prompts x {args.max_new_tokens} new tokens, greedy, float32, one "
        "request at a time, in-process engine, each pass in a fresh engine; shares of the profiled "
        "engine step time. Steps include each request's prefill step.")
    for m, r in res.items():
        if r.get("breakdown"):
            table += (f"\n\nInside the `{m}` draft proposal (cumulative time, share of the "
                      "proposal's; nested calls overlap):\n\n" + fmt_table(r["breakdown"]))
    recorded = {k: os.path.relpath(v, REPO) if k in ("target", "drafter", "prompts") else v
                for k, v in vars(args).items()
                if k not in ("method", "out", "profile", "breakdown_pass")}
    write_result(args.name, {"args": recorded, "methods": res}, table)


if __name__ == "__main__":
    main()
