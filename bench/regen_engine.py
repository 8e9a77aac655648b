"""Regeneration through vLLM against the ``hf`` backend: tokens/s, and how often the greedy
answers differ.

    python bench/regen_engine.py                                   # tiny target, 200 prompts
    python bench/regen_engine.py --target smollm2 --prompts artifacts/smollm2/prompts/eval.jsonl \
        --num-prompts 64 --max-new-tokens 128 --name regen_engine_smollm2

Runs ``regenerate.py`` on the same prompts with ``backend=hf`` and ``backend=vllm`` (the
offline engine, batched), each at the dtypes asked for, and compares every row with the
float32 ``hf`` rows (the reference: the labels of ``features=cache`` come from the same HF
forward): the share of identical answers and the mean first differing position.
Throughput is the backend's own generated tokens/s (engine start-up excluded, model load
excluded for hf too). Writes ``bench/results/<name>.{json,md}``; runs already written are
read back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from common import REPO, fmt_table, machine_info, write_result


def regenerate(out: Path, args: argparse.Namespace, backend: str, dtype: str) -> dict:
    """One ``regenerate.py`` run into ``out`` (read back when its summary exists)."""
    done = out / "summary.json"
    if not done.is_file() or json.loads(done.read_text()).get("status") != "ok":
        cmd = [sys.executable, str(REPO / "regenerate.py"), f"target={args.target}",
               f"sources=[{{path:{args.prompts},field:prompt,name:p}}]",
               f"num_prompts={args.num_prompts}", f"generation.max_new_tokens={args.max_new_tokens}",
               f"backend={backend}", f"target.dtype={dtype}", f"out={out}", "progress=false",
               f"hf.batch_size={args.batch_size}", f"vllm.max_num_seqs={args.batch_size}"]
        subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads((out / "summary.json").read_text())


def rows(out: Path) -> dict[str, list[int]]:
    got = {}
    for shard in sorted(out.glob("shard-*.parquet")):
        for r in pq.read_table(shard).to_pylist():
            got[r["id"]] = r["input_ids"][r["prompt_len"]:]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--prompts", default="artifacts/tiny/prompts/eval.jsonl")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--name", default="regen_engine_tiny")
    args = ap.parse_args()
    work = REPO / "outputs" / "bench" / args.name
    runs = {(b, d): regenerate(work / f"{b}_{d}", args, b, d)
            for d in args.dtypes for b in ("hf", "vllm")}
    ref = rows(work / "hf_float32")
    table = []
    for (b, d), summary in runs.items():
        got = rows(work / f"{b}_{d}")
        same, firsts = 0, []
        for k, want in ref.items():
            have = got.get(k, [])
            if have == want:
                same += 1
                continue
            firsts.append(next((i for i, (x, y) in enumerate(zip(have, want)) if x != y),
                               min(len(have), len(want))))
        tps = summary["throughput"]["gen_tokens_per_s"]
        base = runs[("hf", d)]["throughput"]["gen_tokens_per_s"]
        table.append({"backend": b, "dtype": d, "rows": len(got),
                      "gen tok/s": tps, "x hf (same dtype)": tps / base,
                      "identical to hf float32": same / len(ref),
                      "mean first diff position": sum(firsts) / len(firsts) if firsts else None})
    payload = {"machine": machine_info(), "target": args.target, "prompts": args.prompts,
               "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
               "batch": args.batch_size, "rows": table}
    text = fmt_table(table)
    path = write_result(args.name, payload, text)
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
