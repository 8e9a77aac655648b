"""Suffix decoding exactly as vLLM's ``speculative_config={"method": "suffix"}`` runs it.

vLLM's ``SuffixDecodingProposer`` (``vllm/v1/spec_decode/suffix_decoding.py``) drives
arctic-inference's ``SuffixDecodingCache`` (the official SuffixDecoding): per request a prompt
tree, plus one global tree of every response served so far (the running request's own included)
holding up to ``max_cached_requests`` responses. Each step it appends the newly committed
tokens, matches the last ``max_tree_depth`` tokens of the sequence and drafts one path (no
tree) of at most ``num_speculative_tokens`` (default ``max_tree_depth``) tokens, limited to
``max_spec_factor`` × the matched length and to tokens of estimated probability >=
``min_token_prob``. This module makes the same calls in the same order, so an in-process
evaluation drafts token for token what the engine drafts.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from dflash_lit.errors import UserError

INSTALL_HINT = (
    "pip install nanobind grpcio-tools && CMAKE_PREFIX_PATH=$(python -m nanobind --cmake_dir) "
    "pip install --no-build-isolation arctic-inference==0.3.0"
)


@dataclass(frozen=True)
class SuffixSettings:
    """vLLM's ``suffix_decoding_*`` settings (its defaults)."""

    max_tree_depth: int = 24  # suffix_decoding_max_tree_depth
    num_speculative_tokens: int | None = None  # None: max_tree_depth (vLLM's default)
    max_spec_factor: float = 1.0  # suffix_decoding_max_spec_factor
    min_token_prob: float = 0.1  # suffix_decoding_min_token_prob
    max_cached_requests: int = 10000  # suffix_decoding_max_cached_requests (0: no global tree)

    @property
    def spec_tokens(self) -> int:
        return self.max_tree_depth if self.num_speculative_tokens is None else self.num_speculative_tokens

    def validate(self) -> None:
        """One line naming the ``suffix.*`` key that is out of range."""
        checks = (
            ("max_tree_depth", self.max_tree_depth >= 1, ">= 1"),
            ("num_speculative_tokens", self.spec_tokens >= 1, ">= 1 or null"),
            ("max_spec_factor", self.max_spec_factor >= 0, ">= 0"),
            ("min_token_prob", 0 <= self.min_token_prob <= 1, "in [0, 1]"),
            ("max_cached_requests", self.max_cached_requests >= 0, ">= 0"),
        )
        for key, ok, need in checks:
            if not ok:
                raise UserError(f"suffix.{key}={getattr(self, key)!r}: must be {need} "
                                "(vLLM's suffix_decoding_* settings)")

    def vllm_config(self) -> dict[str, object]:
        """The ``speculative_config`` that makes vLLM run these settings."""
        return {
            "method": "suffix",
            "num_speculative_tokens": self.spec_tokens,
            "suffix_decoding_max_tree_depth": self.max_tree_depth,
            "suffix_decoding_max_spec_factor": self.max_spec_factor,
            "suffix_decoding_min_token_prob": self.min_token_prob,
            "suffix_decoding_max_cached_requests": self.max_cached_requests,
        }


def _cache_class(where: str = "method suffix"):
    """arctic-inference's cache class; one line naming ``where`` and the install when missing."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        raise UserError(
            f"{where}: suffix decoding runs arctic-inference's SuffixDecodingCache (as vLLM "
            f"does), which is not installed: bash scripts/install_engine.sh, or {INSTALL_HINT}"
        ) from None
    return SuffixDecodingCache


def require_cache(where: str) -> None:
    """Fail now, in one line, if suffix decoding cannot run (e.g. before training starts)."""
    _cache_class(where)


class EngineSuffix:
    """One engine's suffix cache shared by the requests of an evaluation, served in order."""

    def __init__(self, settings: SuffixSettings | None = None) -> None:
        self.settings = settings or SuffixSettings()
        self.settings.validate()
        self.cache = _cache_class()(max_tree_depth=self.settings.max_tree_depth,
                                    max_cached_requests=self.settings.max_cached_requests)

    def start(self, req_id: Hashable, prompt: Sequence[int]) -> None:
        """A new request: its prompt tree (a reused id's cached response is evicted first)."""
        if req_id in self.cache.active_requests:
            self.cache.stop_request(req_id)
        if req_id in self.cache.cached_requests:
            self.cache.evict_cached_response(req_id)
        self.cache.start_request(req_id, list(prompt))

    def propose(self, req_id: Hashable, new_tokens: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """Record ``new_tokens`` (committed since the last call) and draft after ``tokens``
        (prompt + output so far)."""
        s = self.settings
        self.cache.add_active_response(req_id, list(new_tokens))
        pattern = list(tokens[max(0, len(tokens) - s.max_tree_depth):])
        draft = self.cache.speculate(req_id, pattern, max_spec_tokens=s.spec_tokens,
                                     max_spec_factor=s.max_spec_factor,
                                     min_token_prob=s.min_token_prob)
        return list(draft.token_ids)

    def stop(self, req_id: Hashable) -> None:
        """The request finished: drop its prompt tree (its response stays in the global tree)."""
        if req_id in self.cache.active_requests:
            self.cache.stop_request(req_id)
