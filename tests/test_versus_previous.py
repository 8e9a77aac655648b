"""bench/versus_previous.py refuses bad arguments in one line, before any worktree or run."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "versus_previous.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_long_must_exceed_short():
    r = run("--short", "5", "--long", "5")
    assert r.returncode != 0 and "--long (5) must be larger than --short (5)" in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_revision_is_one_line():
    r = run("--rev", "no-such-rev-0123")
    assert r.returncode != 0 and "--rev no-such-rev-0123: no such commit" in r.stderr
    assert "Traceback" not in r.stderr
