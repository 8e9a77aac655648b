"""``vllm`` backend: the target in vLLM's offline engine (``vllm.LLM``), continuous batching.

The prompts' token ids are sent as they are stored; requests go to the engine in chunks of
``chunk`` prompts so finished rows reach the shard writer (and a rerun resumes) as they come.
Each response is cut at its first stop token / stop string exactly as the ``hf`` backend cuts
it, so both backends store the same kind of sequence. vLLM spawns its engine in a separate
process: a script that builds this backend needs the ``if __name__ == "__main__":`` guard
(``regenerate.py`` has it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

from dflash_lit.data.backends import GenerationSettings, GenRequest, GenResult
from dflash_lit.data.backends.hf import cut_at_stop
from dflash_lit.errors import UserError

log = logging.getLogger(__name__)


class VLLMBackend:
    """Greedy / sampled generation by vLLM's offline engine on this machine."""

    name = "vllm"

    def __init__(self, target: str, tokenizer: Any, gen: GenerationSettings,
                 dtype: str = "auto", max_num_seqs: int = 64, max_model_len: int | None = None,
                 memory_fraction: float = 0.2, chunk: int = 256,
                 extra_args: dict[str, Any] | None = None) -> None:
        try:
            from vllm import LLM, SamplingParams
        except ImportError:
            raise UserError("backend=vllm: vLLM is not installed; install it with "
                            "bash scripts/install_engine.sh (CPU) or pip install vllm (GPU)") from None
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.tokenizer, self.gen, self.chunk = tokenizer, gen, int(chunk)
        limit = {} if max_model_len is None else {"max_model_len": int(max_model_len)}
        self.llm = LLM(model=target, dtype="float32" if dtype == "auto" else dtype,
                       max_num_seqs=int(max_num_seqs), gpu_memory_utilization=float(memory_fraction),
                       seed=gen.seed, **limit, **(extra_args or {}))
        self.params = SamplingParams(
            temperature=gen.temperature, top_p=gen.top_p if not gen.greedy else 1.0,
            top_k=gen.top_k if (gen.top_k and not gen.greedy) else 0,
            max_tokens=gen.max_new_tokens, stop=list(gen.stop) or None,
            stop_token_ids=list(gen.stop_token_ids), include_stop_str_in_output=True,
            seed=gen.seed)
        self._stats = {"requests": 0, "chunks": 0}

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        """Yield one result per request, a chunk of requests at a time."""
        reqs = list(requests)
        for start in range(0, len(reqs), self.chunk):
            part = reqs[start:start + self.chunk]
            outs = self.llm.generate([{"prompt_token_ids": r.prompt_ids} for r in part],
                                     self.params, use_tqdm=False)
            self._stats["chunks"] += 1
            for req, out in zip(part, outs):
                ids, reason = cut_at_stop(list(out.outputs[0].token_ids), self.gen.stop_token_ids,
                                          self.gen.stop, self.tokenizer)
                self._stats["requests"] += 1
                yield GenResult(req.id, ids, reason)

    def stats(self) -> dict[str, Any]:
        import vllm

        return {**self._stats, "vllm_version": vllm.__version__}
