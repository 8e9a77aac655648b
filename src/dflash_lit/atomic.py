"""Atomic file writes: temporary name in the same directory, fsync, rename, fsync the dir.

A kill at any moment leaves either the old file or the complete new one under the final
name, never a partial file; a failed write (disk full, quota, permissions) removes its
temporary file and raises one OSError that names the file and says what is intact.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Persist a rename: fsync the directory entry (best effort where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _RecordingFile:
    """File proxy that remembers the OSError of a failed ``write``: serialisers like
    ``torch.save`` turn it into an opaque RuntimeError ("unexpected pos ...")."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name: str):
        return getattr(self._f, name)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object],
                 what: str = "file", intact: str = "the previous files there are intact") -> Path:
    """Write ``path`` through ``write(fileobj)`` atomically; returns the path."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"could not create {path.parent} for {what} {path.name}: "
                               f"{e.strerror or e}") from e
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    rec: _RecordingFile | None = None
    try:
        with open(tmp, "wb") as f:
            rec = _RecordingFile(f)
            write(rec)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        cause = e if isinstance(e, OSError) else (rec.error if rec else None)
        if cause is None:
            raise
        raise OSError(cause.errno, f"could not write {what} {path}: {cause.strerror or cause}; "
                                   f"{intact} (free space or fix permissions, then rerun)") from e
    fsync_dir(path.parent)
    return path
