"""Atomic file writes: temporary name in the same directory, fsync, rename, fsync the dir.

A kill at any moment leaves either the old file or the complete new one under the final
name, never a partial file; a failed write (disk full, quota, permissions) removes its
temporary file and raises one OSError that names the file and says what is intact. A SIGKILL
mid-write cannot remove its temporary: the name carries the writer's host and PID so a later
run can tell a dead writer's leftover from a live write and delete it
(``remove_stale_temporaries``). Directories (a built model, a feature cache) are written the
same way under the same kind of name and swapped in whole (``replace_dir``, ``publish_dir``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"
_TMP = re.compile(r"^\..+\.tmp-(?P<host>.+)-(?P<pid>\d+)$")


def temporary_name(path: Path, pid: int | None = None) -> Path:
    """``.NAME.tmp-HOST-PID`` beside ``path``: where process ``pid`` (default: this one) writes
    before the rename."""
    return path.with_name(f".{path.name}.tmp-{_HOST}-{os.getpid() if pid is None else pid}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(dirs: Iterable[str | os.PathLike]) -> list[Path]:
    """Delete temporaries in ``dirs`` left by killed writers on this host; returns them.

    A temporary whose writer is alive (a concurrent save) or ran on another host (a shared
    filesystem) is kept: only a dead local PID proves the file will never be renamed.
    """
    removed = []
    for d in dirs:
        for f in Path(d).glob(".*.tmp-*"):
            m = _TMP.match(f.name)
            if m and m["host"] == _HOST and not _pid_alive(int(m["pid"])):
                if f.is_dir() and not f.is_symlink():
                    shutil.rmtree(f, ignore_errors=True)
                else:
                    f.unlink(missing_ok=True)
                removed.append(f)
    return removed


def replace_dir(tmp: Path, path: Path) -> None:
    """Swap the finished directory ``tmp`` (a ``temporary_name``) in for ``path``: the old
    directory, if any, moves to a temporary name of its own first and is deleted after, so a
    kill leaves the old or the new directory under ``path`` plus leftovers a later run removes."""
    old = temporary_name(path.with_name(path.name + ".old"))
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def publish_dir(tmp: Path, path: Path, info: dict) -> dict:
    """Finish a built directory: files world-readable (safetensors writes 0600), their sha256
    and size recorded in ``info["files"]``, ``info`` written as ``build_info.json``, then
    swapped in for ``path`` (``replace_dir``). Returns ``info``."""
    from dflash_lit.hashing import sha256_file

    files = sorted(f.name for f in tmp.iterdir() if f.is_file())
    for f in files:
        os.chmod(tmp / f, 0o644)
    info = dict(info, files={f: {"sha256": sha256_file(tmp / f), "bytes": (tmp / f).stat().st_size}
                             for f in files})
    (tmp / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    replace_dir(tmp, path)
    return info


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
    tmp = temporary_name(path)
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
