"""One engine run of ``evaluate.py engine=vllm``, in its own process.

``python -m dflash_lit.eval.vllm_worker JOB.json RESULT.json``: starts a ``vllm.LLM`` with the
job's settings (one speculative method), serves the job's prompts (token ids) greedily with
``concurrency`` requests in flight and writes, per request, the output ids, the tokens each
engine step committed (streamed deltas: the exact verify-step count), the engine's per-step
accepted / drafted counts, and the wall time. Progress (requests finished) goes to
``RESULT.json.progress``. A process of its own because vLLM spawns engine processes and keeps
global state: a fresh engine per method (suffix decoding's cache starts empty, as it would in a
freshly started server) and a crash that cannot take the evaluator down with it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def run(job: dict[str, Any], progress_path: Path) -> dict[str, Any]:
    """Serve ``job["prompts"]`` with the job's engine settings; returns the result dict."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    spec = job.get("speculative_config")
    kwargs = dict(job.get("llm_kwargs") or {})
    if spec is not None:
        kwargs.update(speculative_config=spec, disable_log_stats=False,
                      per_request_spec_decode_metrics="detailed")
    t0 = time.perf_counter()
    llm = LLM(model=job["target"], tokenizer=job.get("tokenizer") or job["target"],
              dtype=job["dtype"], max_num_seqs=int(job["concurrency"]), seed=0, **kwargs)
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]),
                            stop_token_ids=list(job.get("stop_token_ids") or []),
                            output_kind=RequestOutputKind.DELTA)
    prompts: list[list[int]] = job["prompts"]
    n, conc = len(prompts), int(job["concurrency"])
    reqs: list[dict[str, Any]] = [
        {"tokens": [], "steps": [], "accepted": None, "drafted": None}
        for _ in prompts
    ]
    nxt, finished = 0, 0
    t_run = time.perf_counter()

    def admit() -> None:
        nonlocal nxt
        while nxt < n and nxt - finished < conc:
            engine.add_request(str(nxt), {"prompt_token_ids": prompts[nxt]}, params)
            nxt += 1

    admit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = reqs[int(out.request_id)]
            delta = list(out.outputs[0].token_ids)
            if delta:  # one engine step committed these tokens for this request
                r["tokens"] += delta
                r["steps"].append(len(delta))
            if out.finished:
                m = out.outputs[0].spec_decode_metrics
                if m is not None:
                    r["accepted"], r["drafted"] = list(m.per_step_accepted), list(m.per_step_drafted)
                r["finish_reason"] = out.outputs[0].finish_reason
                r["done_s"] = time.perf_counter() - t_run  # shows one-time costs in the timed region
                finished += 1
                progress_path.write_text(f"{finished} {n}\n")
        admit()
    wall = time.perf_counter() - t_run
    return {"requests": reqs, "wall_time_s": wall, "startup_s": startup,
            "vllm_version": vllm.__version__, "speculative_config": spec, "llm_kwargs": kwargs,
            "concurrency": conc}


def main(argv: list[str]) -> int:
    job_path, out_path = Path(argv[0]), Path(argv[1])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories: no 25 s of hub retries
    job = json.loads(job_path.read_text())
    res = run(job, out_path.with_name(out_path.name + ".progress"))
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res))
    tmp.replace(out_path)  # the result file exists only when the run completed
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
