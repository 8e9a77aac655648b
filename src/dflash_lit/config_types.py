"""Config values checked against the annotations of the code that takes them.

Hydra passes command-line values through as typed YAML (``data.token_budget=abc`` is the
string ``'abc'``); checking them against the receiving signature turns a ``TypeError`` deep
inside setup into one line naming the key, before anything heavy loads.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

from dflash_lit.errors import UserError

_NAMES = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
          list: "a list", tuple: "a list", Sequence: "a list", dict: "a mapping", type(None): "null"}


def hints_of(obj: type | Callable[..., Any]) -> dict[str, Any]:
    """Parameter name → annotation: dataclass fields, else the parameters of ``__init__``
    (for a class) or of the callable; unannotated parameters map to ``Any``."""
    if dataclasses.is_dataclass(obj):
        hints = typing.get_type_hints(obj)
        return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(obj) if f.init}
    fn = obj.__init__ if inspect.isclass(obj) else obj
    hints = typing.get_type_hints(fn)
    params = inspect.signature(fn).parameters
    return {n: hints.get(n, Any) for n, p in params.items()
            if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` (plain YAML data) fits the annotation ``hint``."""
    origin = typing.get_origin(hint)
    if hint is Any or isinstance(hint, typing.TypeVar):
        return True
    if origin in (Union, types.UnionType):
        return any(matches(value, a) for a in typing.get_args(hint))
    if hint is type(None) or hint is None:
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    base = origin or hint
    if base in (list, tuple, Sequence):
        if not isinstance(value, list | tuple):
            return False
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return len(args) != 1 or all(matches(v, args[0]) for v in value)
    if base in (dict, Mapping):
        return isinstance(value, dict)
    return True  # anything more specific is the receiver's to check


def describe(hint: Any) -> str:
    """Plain words for an annotation: ``int | None`` → ``an integer or null``."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(hint))
    return _NAMES.get(typing.get_origin(hint) or hint, getattr(hint, "__name__", str(hint)))


def check_values(values: Mapping[str, Any], hints: Mapping[str, Any], prefix: str,
                 hint: str = "") -> None:
    """Raise ``UserError`` for a key of ``values`` not in ``hints`` or a value of another
    type, naming the key as ``<prefix>.<key>``; ``hint`` is appended to the unknown-key error."""
    for key, value in values.items():
        if key not in hints:
            raise UserError(f"{prefix}.{key}: unknown key; accepted: {sorted(hints)}{hint}")
        if not matches(value, hints[key]):
            raise UserError(f"{prefix}.{key}={value!r}: expected {describe(hints[key])}")
