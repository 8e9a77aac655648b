"""User errors: bad configuration, files or data, reported as one line by every entry point.

A ``UserError`` message says what is wrong, where (config key or file:line) and what to do;
``dflash_lit.cli.entry_point`` prints it without a traceback and exits 2. Anything else is
a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class UserError(ValueError):
    """Bad input from the user; the message is the whole report."""


# Also reported as one line: files and directories that are missing, unreadable or unwritable
# (the message names the path), and a disk that is full.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, OSError)


@contextmanager
def input_checks() -> Iterator[None]:
    """Inside this block every ``ValueError`` describes the user's input: re-raise it as a
    ``UserError`` (the original stays the ``__cause__``).

    For phases that only validate and load what the user gave (config values, data, a
    checkpoint), whose validators raise plain ``ValueError`` (also when Hydra's
    ``instantiate`` wraps it).
    """
    from hydra.errors import InstantiationException

    try:
        yield
    except UserError:
        raise
    except ValueError as e:
        raise UserError(str(e)) from e
    except InstantiationException as e:  # hydra.utils.instantiate wraps the constructor's error
        if isinstance(e.__cause__, ValueError):
            raise UserError(str(e.__cause__)) from e.__cause__
        raise


def one_line(err: BaseException) -> str:
    """The error's message on one line (whitespace runs, newlines included, become a space)."""
    return " ".join(str(err).split()) or type(err).__name__
