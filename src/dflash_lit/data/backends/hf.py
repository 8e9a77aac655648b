"""``hf`` backend: the target's own ``generate``, batched with LEFT padding.

Prompts are sorted by length (longest first) so a batch pads little and an out-of-memory
shows up at once. Each row is cut after its first stop token / stop string *after*
generation, so a row's result does not depend on what else was in its batch: greedy output
with padding equals greedy output of the prompt alone.

A batch is generated ``segment_tokens`` at a time, and the rows that stopped leave the batch
(their KV cache rows dropped) between segments: with one ``generate`` call per batch, every
row would be computed until the batch's longest answer ends (answers of a chat model stop
anywhere between a few tokens and ``max_new_tokens``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from dflash_lit.data.backends import GenerationSettings, GenRequest, GenResult
from dflash_lit.errors import UserError

log = logging.getLogger(__name__)


def cut_at_stop(
    gen_ids: Sequence[int],
    stop_ids: Sequence[int],
    stop_strings: Sequence[str],
    tokenizer: Any,
) -> tuple[list[int], str]:
    """Cut generated ids after the first stop token or the token completing a stop string.

    Returns (ids kept, finish_reason): ``stop`` if cut, else ``length``.
    """
    ids = list(gen_ids)
    cut = None
    stop_set = set(stop_ids)
    for k, t in enumerate(ids):
        if t in stop_set:
            cut = k + 1
            break
    if stop_strings:
        scan = ids[:cut] if cut is not None else ids

        def hit(k: int) -> bool:
            text = tokenizer.decode(scan[:k])
            return any(s in text for s in stop_strings)

        if scan and hit(len(scan)):
            lo, hi = 1, len(scan)  # smallest k with hit(k): decode of a prefix only grows
            while lo < hi:
                mid = (lo + hi) // 2
                if hit(mid):
                    hi = mid
                else:
                    lo = mid + 1
            cut = lo
    if cut is None:
        return ids, "length"
    return ids[:cut], "stop"


class HFBackend:
    """Batched greedy / sampled generation with transformers on one device."""

    name = "hf"

    def __init__(
        self,
        target: str,
        tokenizer: Any,
        gen: GenerationSettings,
        batch_size: int = 8,
        device: str = "auto",
        dtype: str = "auto",
        attn_implementation: str | None = None,
        segment_tokens: int | None = 32,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        from dflash_lit.dtypes import parse_dtype

        if batch_size < 1:
            raise UserError(f"hf.batch_size: must be >= 1, got {batch_size}")
        if segment_tokens is not None and segment_tokens < 1:
            raise UserError(f"hf.segment_tokens: must be >= 1 or null, got {segment_tokens}")
        self.segment = int(segment_tokens) if segment_tokens else None
        self.tokenizer, self.gen, self.batch_size = tokenizer, gen, int(batch_size)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        torch_dtype = parse_dtype(dtype, "hf.dtype", device=self.device)
        try:
            kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
            model = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype, **kw)
        except Exception as e:
            raise UserError(f"hf backend: cannot load the target model from {target}: {e}") from e
        self.model = model.to(self.device).eval()
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = gen.stop_token_ids[0] if gen.stop_token_ids else 0
        self.pad_id = int(pad)
        # Own the generation settings: a checkpoint's generation_config (sampling defaults,
        # repetition penalty ...) must not leak into "greedy".
        self.model.generation_config = GenerationConfig(
            bos_token_id=self.model.config.bos_token_id,
            eos_token_id=list(gen.stop_token_ids) or None,
            pad_token_id=self.pad_id,
        )
        self._calls = 0

    def _generation_config(self, max_new_tokens: int | None = None):
        from transformers import GenerationConfig

        kw: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens or self.gen.max_new_tokens,
            do_sample=not self.gen.greedy,
            eos_token_id=list(self.gen.stop_token_ids) or None,
            pad_token_id=self.pad_id,
        )
        if not self.gen.greedy:
            kw.update(temperature=self.gen.temperature, top_p=self.gen.top_p, top_k=self.gen.top_k)
        if self.gen.stop:
            kw["stop_strings"] = list(self.gen.stop)
        return GenerationConfig(**kw)

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        """Yield results batch by batch, longest prompts first."""
        import torch

        reqs = sorted(requests, key=lambda r: (-len(r.prompt_ids), r.id))
        gc = self._generation_config()
        torch.manual_seed(self.gen.seed)
        for start in range(0, len(reqs), self.batch_size):
            batch = reqs[start : start + self.batch_size]
            width = max(len(r.prompt_ids) for r in batch)
            input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):  # LEFT padding: generated tokens line up at the end
                input_ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
                attention[row, width - len(r.prompt_ids) :] = 1
            kw: dict[str, Any] = {"tokenizer": self.tokenizer} if self.gen.stop else {}
            with torch.inference_mode():
                if self.segment is None:
                    out = self.model.generate(
                        input_ids=input_ids.to(self.device),
                        attention_mask=attention.to(self.device),
                        generation_config=gc,
                        **kw,
                    )
                    self._calls += 1
                    new = out[:, width:].tolist()
                else:
                    new = self._generate_segments(input_ids, attention, kw)
            stopped_early = max(map(len, new)) < self.gen.max_new_tokens  # every row stopped
            for r, gen_ids in zip(batch, new):
                ids, reason = cut_at_stop(gen_ids, self.gen.stop_token_ids, self.gen.stop, self.tokenizer)
                if reason == "length" and stopped_early:
                    # generate saw a stop string our decode-based scan missed: drop its padding.
                    while ids and ids[-1] == self.pad_id:
                        ids.pop()
                    reason = "stop"
                    log.warning("hf backend: %s stopped without a detectable stop; trimmed padding", r.id)
                yield GenResult(id=r.id, gen_ids=ids, finish_reason=reason)

    def _generate_segments(self, input_ids, attention, kw: dict[str, Any]) -> list[list[int]]:
        """Generated ids per row, ``segment_tokens`` at a time; rows that stopped leave the
        batch (and their cache rows) between segments; rows never see each other, so each
        row's tokens are those of a single ``generate`` call."""
        import torch

        seqs, attn = input_ids.to(self.device), attention.to(self.device)
        rows = list(range(seqs.shape[0]))
        new: list[list[int]] = [[] for _ in rows]
        cache, produced = None, 0
        while rows and produced < self.gen.max_new_tokens:
            seg = min(self.segment, self.gen.max_new_tokens - produced)
            out = self.model.generate(input_ids=seqs, attention_mask=attn,
                                      generation_config=self._generation_config(seg),
                                      past_key_values=cache, use_cache=True,
                                      return_dict_in_generate=True, **kw)
            self._calls += 1
            tail = out.sequences[:, seqs.shape[1]:]
            produced += tail.shape[1]
            for i, r in enumerate(rows):
                new[r].extend(tail[i].tolist())
            keep = [i for i, r in enumerate(rows) if cut_at_stop(
                new[r], self.gen.stop_token_ids, self.gen.stop, self.tokenizer)[1] == "length"]
            if tail.shape[1] < seg or not keep:
                break  # every row stopped
            index = torch.tensor(keep, device=self.device)
            cache = out.past_key_values
            cache.batch_select_indices(index)
            seqs = out.sequences[index]
            attn = torch.cat([attn, torch.ones_like(tail)], dim=1)[index]
            rows = [rows[i] for i in keep]
        return new

    def stats(self) -> dict[str, Any]:
        return {"generate_calls": self._calls, "batch_size": self.batch_size, "device": str(self.device)}
