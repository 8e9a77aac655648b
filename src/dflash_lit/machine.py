"""What this machine is, for records written next to results (model cards, bench files)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    """``"<CPU model>, <N> cores"``: the machine a timing was measured on."""
    return f"{cpu_name()}, {os.cpu_count()} cores"
