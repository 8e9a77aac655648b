"""Generation backends for regeneration: ``hf`` (batched ``generate``), ``openai`` (a server)
and ``vllm`` (vLLM's offline engine on this machine).

A backend takes ``GenRequest``s and yields one ``GenResult`` per request, in any order.
Generated tokens *include* the stop token / stop string that ended the response (the target
produced it; the drafter learns where turns end), so both backends give the same sequences.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dflash_lit.errors import UserError


@dataclass
class GenRequest:
    """One prompt to complete: its tokens (what is stored) and what a server is sent."""

    id: str
    source: str
    prompt_ids: list[int]
    prompt_text: str  # the rendered prompt (chat template applied when chat is on)
    messages: list[dict[str, str]] | None = None  # for the chat endpoint


@dataclass
class GenResult:
    """Generated tokens for one request; ``finish_reason`` is ``stop`` or ``length``."""

    id: str
    gen_ids: list[int]
    finish_reason: str


@dataclass
class GenerationSettings:
    """Sampling settings shared by the backends (``temperature == 0`` means greedy)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # eos ids included
    eos_token_id: int | None = None  # appended for an openai "stop" that reports no reason
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


class Backend(Protocol):
    """What ``regenerate.run`` needs from a backend."""

    name: str

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        """Yield one result per request (any order); raise on a fatal failure."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for the summary (requests, retries, errors by kind, ...)."""
        ...


def eos_token_ids(target: str, tokenizer: Any) -> list[int]:
    """End-of-sequence ids: the tokenizer's eos plus ``generation_config.json``'s (if any)."""
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    gc = Path(target) / "generation_config.json"
    if gc.is_file():
        eos = json.loads(gc.read_text()).get("eos_token_id")
        for t in [eos] if isinstance(eos, int) else (eos or []):
            if int(t) not in ids:
                ids.append(int(t))
    return ids


def make_backend(name: str, cfg: Any, target: str, tokenizer: Any, gen: GenerationSettings) -> Backend:
    """Build the backend named by the ``backend`` config key from its options group."""
    if name == "hf":
        from dflash_lit.data.backends.hf import HFBackend

        return HFBackend(target, tokenizer, gen, **dict(cfg.hf))
    if name == "openai":
        from dflash_lit.data.backends.openai import OpenAIBackend

        return OpenAIBackend(tokenizer, gen, **dict(cfg.openai))
    if name == "vllm":
        from dflash_lit.data.backends.vllm import VLLMBackend

        return VLLMBackend(target, tokenizer, gen, **dict(cfg.vllm))
    raise UserError(f"backend: {name!r} is not one of 'hf', 'openai', 'vllm'")
