"""Default prompts: stdlib function signatures + docstrings, as they appear in the source.

Each prompt is the text from a ``def`` line through the end of its docstring, dedented, e.g.
``def name(args):\n    \"\"\"docstring\"\"\"\n``; the target then completes the body. Prompts are
split train/eval by a stable hash of ``module:qualname`` so no function is in both.
"""

from __future__ import annotations

import ast
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

from .corpus import SourceFile, stable_fraction


def module_name(rel: str) -> str:
    """Dotted module name of a stdlib-relative path (``json/decoder.py`` -> ``json.decoder``)."""
    mod = rel[:-3] if rel.endswith(".py") else rel
    mod = mod.replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def _functions(node: ast.AST, prefix: str = ""
               ) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualname, node) of every function in source order, methods and nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child
            yield from _functions(child, f"{prefix}{child.name}.<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        elif not isinstance(child, ast.expr):
            yield from _functions(child, prefix)


def extract_prompts(src: SourceFile, min_doc_chars: int = 16, max_chars: int = 1500
                    ) -> list[dict]:
    """Signature + docstring prompts of one file (functions with a body after the docstring)."""
    try:
        tree = ast.parse(src.text)
    except (SyntaxError, ValueError):
        return []
    lines = src.text.splitlines(keepends=True)
    mod = module_name(src.rel)
    out = []
    for qual, fn in _functions(tree):
        doc = ast.get_docstring(fn, clean=False)
        if not doc or len(doc.strip()) < min_doc_chars or len(fn.body) < 2:
            continue
        first = fn.body[0]
        if first.end_lineno is None or first.end_lineno >= fn.body[1].lineno:
            continue  # docstring shares a line with the next statement
        text = "".join(lines[fn.lineno - 1: first.end_lineno])
        if not text.lstrip().startswith(("def ", "async def ")):
            continue  # odd layouts (e.g. def on a decorator line)
        text = textwrap.dedent(text)
        if not text.endswith("\n"):
            text += "\n"
        if len(text) > max_chars:
            continue
        out.append({"id": f"{mod}:{qual}", "source": "stdlib", "prompt": text})
    return out


def build_prompts(files: list[SourceFile], eval_frac: float = 0.1, max_train: int = 4000,
                  max_eval: int = 200) -> tuple[list[dict], list[dict]]:
    """(train, eval) prompt lists: deduplicated by id and by text, split by hash of the id,
    capped by a second stable hash (so the choice is unbiased), then sorted by id."""
    seen_ids: set[str] = set()
    seen_text: set[str] = set()
    train, evals = [], []
    for f in sorted(files, key=lambda f: f.rel):
        for rec in extract_prompts(f):
            if rec["id"] in seen_ids or rec["prompt"] in seen_text:
                continue
            seen_ids.add(rec["id"])
            seen_text.add(rec["prompt"])
            (evals if stable_fraction("prompt-split:" + rec["id"]) < eval_frac else train).append(rec)

    def cap(recs: list[dict], n: int) -> list[dict]:
        recs = sorted(recs, key=lambda r: stable_fraction("prompt-pick:" + r["id"]))[:n]
        return sorted(recs, key=lambda r: r["id"])

    return cap(train, max_train), cap(evals, max_eval)


def write_jsonl(recs: list[dict], path: Path) -> None:
    """One JSON object per line (UTF-8, keys in insertion order)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for r in recs:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """Inverse of :func:`write_jsonl`."""
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
