"""Varied code prompts for chat targets, cut from the Python standard library's own source.

Two families, both split train/eval by a stable hash of ``module:qualname`` (the same split as
the embedded stdlib prompts, so a function never sits in both), both cleared of HumanEval
overlap (``prompts.overlaps_humaneval``):

- ``complete``: a function's signature + docstring to finish, either bare (as evaluation
  renders HumanEval: the code alone as the user message) or wrapped in an instruction.
- ``tasks``: a whole function or class with a task around it: explain, test, refactor, type,
  review, document, translate, summarise, use.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator

from dflash_lit.tiny.corpus import SourceFile, stable_fraction
from dflash_lit.tiny.prompts import extract_prompts, module_name

EVAL_FRAC = 0.1  # the embedded prompts' eval share (tiny.prompts.build_prompts)

COMPLETE_TEMPLATES = (
    "{code}",  # bare, as HumanEval is rendered at evaluation
    "{code}",
    "Complete this Python function:\n```python\n{code}```",
    "Implement the body of this Python function and reply with the whole function:\n"
    "```python\n{code}```",
    "Write the implementation of the following function:\n```python\n{code}```",
    "Finish this function from the Python standard library module `{module}`:\n"
    "```python\n{code}```",
)
FUNCTION_TASKS = (
    "Explain what this Python function does, step by step:\n```python\n{code}```",
    "Write pytest unit tests for this function:\n```python\n{code}```",
    "Refactor this function to make it shorter and easier to read:\n```python\n{code}```",
    "Add type hints to this function and return the updated code:\n```python\n{code}```",
    "Review this code. Are there any bugs or edge cases it misses?\n```python\n{code}```",
    "Write a docstring for this function:\n```python\n{code}```",
    "Translate this Python function into JavaScript:\n```python\n{code}```",
    "Summarize in two sentences what this code from `{module}` is for:\n```python\n{code}```",
    "{code}\nWhat does this function return? Give an example call.",
)
CLASS_TASKS = (
    "Explain what this Python class does and how to use it:\n```python\n{code}```",
    "Write a short example program that uses this class:\n```python\n{code}```",
    "Write pytest unit tests for this class:\n```python\n{code}```",
    "Suggest improvements to this class:\n```python\n{code}```",
)


def split_of(unit_id: str) -> str:
    """``eval`` or ``train`` for a ``module:qualname`` (the embedded prompts' split)."""
    return "eval" if stable_fraction("prompt-split:" + unit_id) < EVAL_FRAC else "train"


def pick(key: str, options: tuple[str, ...]) -> str:
    """One of ``options`` by a stable hash of ``key`` (same choice every build)."""
    return options[min(int(stable_fraction(key) * len(options)), len(options) - 1)]


def _units(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """(qualname, node) of top-level functions, classes and methods, in source order."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child
        elif isinstance(child, ast.ClassDef):
            yield prefix + child.name, child
            yield from _units(child, f"{prefix}{child.name}.")


def complete_prompts(files: list[SourceFile]) -> list[dict]:
    """Signature + docstring prompts of every file, bare or wrapped in an instruction."""
    out = []
    for f in files:
        for rec in extract_prompts(f):
            out.append({"id": rec["id"], "source": "complete", "unit": rec["id"],
                        "code": rec["prompt"],
                        "prompt": pick("complete:" + rec["id"], COMPLETE_TEMPLATES).format(
                            code=rec["prompt"], module=rec["id"].split(":", 1)[0])})
    return out


def task_prompts(files: list[SourceFile], min_chars: int = 160, max_chars: int = 1500,
                 max_lines: int = 45) -> list[dict]:
    """A task around each whole function / class of ``min_chars``-``max_chars`` characters."""
    out = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except (SyntaxError, ValueError):
            continue
        lines = f.text.splitlines(keepends=True)
        mod = module_name(f.rel)
        for qual, node in _units(tree):
            end = getattr(node, "end_lineno", None)
            if end is None or end - node.lineno + 1 > max_lines:
                continue
            code = textwrap.dedent("".join(lines[node.lineno - 1:end]))
            if not (min_chars <= len(code) <= max_chars) or not code.lstrip().startswith(
                    ("def ", "async def ", "class ")):
                continue
            if not code.endswith("\n"):
                code += "\n"
            uid = f"{mod}:{qual}"
            tasks = CLASS_TASKS if isinstance(node, ast.ClassDef) else FUNCTION_TASKS
            out.append({"id": uid, "source": "tasks", "unit": uid, "code": code,
                        "prompt": pick("task:" + uid, tasks).format(code=code, module=mod)})
    return out
