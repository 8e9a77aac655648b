"""What every entry point shares: one-line user errors (exit status 2), quiet start-up."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from dflash_lit.errors import USER_ERRORS, one_line
from dflash_lit.warnings import quiet_known_warnings

F = TypeVar("F", bound=Callable[..., Any])

USER_ERROR_EXIT = 2
# Set to 1 to get the full traceback of a user error too (when the message is not enough).
TRACEBACK_ENV = "DFLASH_TRACEBACK"


def entry_point(fn: F) -> F:
    """Wrap a Hydra task function: a user error prints ``error: <message>`` on one stderr line
    and exits 2; any other exception is a bug and propagates with its traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        quiet_known_warnings()
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            if os.environ.get(TRACEBACK_ENV) == "1":
                raise
            sys.stdout.flush()
            print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
            sys.exit(USER_ERROR_EXIT)

    return wrapper  # type: ignore[return-value]
