"""Engine processes that die with whoever started them.

vLLM runs a model in processes of its own (the engine core, its workers). When the process
that started an engine is killed (kill -9, OOM), those stay behind holding the model in
memory. :func:`die_with_parent` asks the kernel to kill a process when its parent dies; the
project calls it in every process it starts an engine from, and :func:`vllm_plugin` (a vLLM
general plugin, loaded by vLLM in each engine process) calls it in the engine's own processes
when the environment asks for it (``DFLASH_DIE_WITH_PARENT=1``, set by the project's engine
launchers, so a user's own ``vllm serve`` is never affected).
"""

from __future__ import annotations

import os

ENV = "DFLASH_DIE_WITH_PARENT"  # "1": every vLLM process started below dies with its parent


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux; elsewhere a no-op)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def vllm_plugin() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins``): die with the parent when the
    project started this engine."""
    if os.environ.get(ENV) == "1":
        die_with_parent()


def engine_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the engine-lifetime switch on."""
    return {**(os.environ if env is None else env), ENV: "1"}
