"""One feature-cache build by vLLM, in its own process.

``python -m dflash_lit.data.vllm_features.worker JOB.json``: starts a ``vllm.LLM`` with the
``extract_hidden_states`` method and the project's connector (``cache`` sink writing into the
job's build directory), sends every row of the job's ``todo.arrow`` (data row + token ids) as
a one-token request, ``max_num_seqs`` in flight, and writes ``<rows done> <rows>`` to
``JOB.progress`` as rows finish (engine start-up and row seconds to ``JOB.stats.json``). A process of its own: vLLM spawns engine processes and keeps
global state, and a crash must not take the trainer with it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def speculative_config(capture: list[int]) -> dict[str, Any]:
    """vLLM's ``speculative_config`` capturing the (vLLM-numbered) layers ``capture``."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture}}}


def run(job: dict[str, Any], progress: Path) -> None:
    import pyarrow as pa
    from vllm import LLM, SamplingParams

    from dflash_lit.data.vllm_features.connector import kv_transfer_config

    t0 = time.perf_counter()
    todo = pa.ipc.open_file(pa.memory_map(job["todo"], "r")).read_all()
    rows = todo.column("row").to_pylist()
    ids = todo.column("input_ids")
    llm = LLM(model=job["target"], tokenizer=job["target"], dtype=job["dtype"], seed=0,
              speculative_config=speculative_config(job["capture"]),
              kv_transfer_config=kv_transfer_config(job["connector"]),
              **job["llm_kwargs"])
    engine = llm.llm_engine
    startup = time.perf_counter() - t0
    params = SamplingParams(max_tokens=1, temperature=0.0)
    n, conc = len(rows), int(job["llm_kwargs"].get("max_num_seqs", 64))
    nxt = finished = 0

    def admit() -> None:
        nonlocal nxt
        while nxt < n and nxt - finished < conc:
            p = params.clone()
            p.extra_args = {"kv_transfer_params": {"dflash_row": int(rows[nxt])}}
            engine.add_request(f"row{rows[nxt]}", {"prompt_token_ids": ids[nxt].as_py()}, p)
            nxt += 1

    admit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished += 1
        progress.write_text(f"{finished} {n}\n")
        admit()
    (progress.with_suffix(".stats.json")).write_text(json.dumps(
        {"startup_s": startup, "rows_s": time.perf_counter() - t0 - startup, "rows": n}))


def main(argv: list[str]) -> int:
    job_path = Path(argv[0])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories: no 25 s of hub retries
    run(json.loads(job_path.read_text()), job_path.with_suffix(".progress"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
