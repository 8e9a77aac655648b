"""Requests an instruct target writes itself (Magpie, arXiv 2406.08464): no dataset needed.

Given only its chat template up to the start of a user turn (the *pre-query* text: the
system turn, then ``<|im_start|>user\\n`` for ChatML), an instruct model continues with
something a user would ask. Sampled at temperature 1, each continuation is one request.
A few system messages and user-turn openings steer the topic towards code without fixing it.

    queries(tokenizer, n)      -> raw-text prompts for ``regenerate.py chat=false`` (sampled)
    requests_from_shards(dir)  -> the written requests, as prompt records
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_lit.tiny.corpus import stable_fraction

SENTINEL = "\x00MAGPIE\x00"
SYSTEMS = (
    None,  # the template's own default system turn
    "You are a helpful coding assistant.",
    "You are an expert Python programmer who answers with code.",
)
OPENINGS = ("", "", "Write a Python function", "How do I", "Can you explain", "Write a program",
            "What is the difference between", "I'm trying to", "Create a", "Fix this code",
            "Write a short", "Why does")
GENERATION = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 64}  # request sampling
MIN_CHARS = 16  # shorter requests are dropped


def pre_query(tokenizer: Any, system: str | None) -> str:
    """The chat template rendered up to where a user message's text would start."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    if SENTINEL not in text:
        raise ValueError("the chat template does not render the user message verbatim")
    return text[: text.index(SENTINEL)]


def queries(tokenizer: Any, n: int) -> list[dict]:
    """``n`` raw-text prompts (pre-query + an opening), ids ``q00000``..., the steering picked
    by a stable hash of the id; the opening is kept in the record to prefix the request."""
    out = []
    for i in range(n):
        qid = f"q{i:05d}"
        system = SYSTEMS[int(stable_fraction("magpie-system:" + qid) * len(SYSTEMS))]
        opening = OPENINGS[int(stable_fraction("magpie-opening:" + qid) * len(OPENINGS))]
        out.append({"id": qid, "opening": opening,
                    "prompt": pre_query(tokenizer, system) + opening})
    return out


def requests_from_shards(shard_dir: Path, openings: dict[str, str], tokenizer: Any) -> list[dict]:
    """The requests the target wrote (finished turns only, at least ``MIN_CHARS``), each
    prefixed by its opening; ids ``magpie:qNNNNN``."""
    import pyarrow.parquet as pq

    out = []
    for shard in sorted(Path(shard_dir).glob("shard-*.parquet")):
        t = pq.read_table(shard, columns=["id", "input_ids", "prompt_len", "finish_reason"])
        for rid, ids, plen, reason in zip(*(t.column(c).to_pylist() for c in t.column_names)):
            if reason != "stop":
                continue  # cut at max_new_tokens: an unfinished request
            qid = rid.split(":", 1)[-1]
            text = tokenizer.decode(ids[plen:], skip_special_tokens=True)
            request = (openings.get(qid, "") + text).strip()
            if len(request) >= MIN_CHARS:
                out.append({"id": f"magpie:{qid}", "prompt": request})
    return sorted(out, key=lambda r: r["id"])
