"""Frozen target LLM wrapper: runs any HF causal LM and captures only the DFlash context layers.

Layer id semantics (z-lab): id ``i`` is the *output* of decoder layer ``i``, i.e. HF
``hidden_states[i + 1]``. HF overwrites its last entry ``hidden_states[L]`` with the final-norm
output, so id ``L - 1`` is captured after the final norm, exactly as HF-based trainers see it.
(Serving engines capture "input of layer id + 1" and therefore cannot provide id ``L - 1``.)

The wrapper is not part of any drafter's state: the LightningModule must hold it *outside* its
module tree (e.g. a plain attribute set with ``object.__setattr__`` or a list), so its weights
never reach a checkpoint, an optimizer or DDP's gradient buckets. Move it with ``.to(device)``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_lit.hf import text_config

_LAYER_LIST_NAMES = ("layers", "h", "blocks")
_FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm")


@dataclass
class TargetOutput:
    """What one frozen-target forward returns.

    hidden: ``[B, S, K*d]`` captured layers concatenated in ``layer_ids`` order.
    logits: ``[B, S, V]`` final logits, or None when not requested.
    layers: the K captured ``[B, S, d]`` tensors (views into ``hidden``).
    cache: the model's KV/recurrent cache when the caller passed ``use_cache=True``, else None.
    """

    hidden: torch.Tensor
    logits: torch.Tensor | None
    layers: list[torch.Tensor]
    cache: Any = None
    argmax: torch.Tensor | None = None  # [B, S] the target's greedy next token (cached features)


class _StopForward(Exception):
    """Raised from a hook once the deepest requested layer has run (logits not needed)."""


def _find_layer_list(decoder: nn.Module) -> nn.ModuleList | None:
    for name in _LAYER_LIST_NAMES:
        layers = getattr(decoder, name, None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    return None


def find_decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """Locate the decoder body and its list of decoder layers in an HF causal LM.

    Tries ``model.model.layers`` (Llama, Qwen3, Qwen3.5/Qwen3-Next hybrids), then
    ``model.get_decoder()`` (multimodal wrappers: ``model.model.language_model.layers``),
    then ``model.base_model``. Raises ValueError when none has a layer list.
    """
    candidates: list[nn.Module] = []
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module):
        candidates.append(inner)
    if hasattr(model, "get_decoder"):
        try:
            candidates.append(model.get_decoder())
        except (AttributeError, NotImplementedError, ValueError):
            pass
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module):
        candidates.append(base)
    candidates.append(model)
    for cand in candidates:
        layers = _find_layer_list(cand)
        if layers is not None:
            return cand, layers
        # Multimodal base models keep the text decoder one level down.
        for sub in ("language_model", "text_model", "decoder"):
            subm = getattr(cand, sub, None)
            if isinstance(subm, nn.Module) and (layers := _find_layer_list(subm)) is not None:
                return subm, layers
    raise ValueError(
        f"could not find the decoder layer list of {type(model).__name__}: looked for "
        f"{'/'.join(_LAYER_LIST_NAMES)} on model.model, get_decoder() and base_model; "
        "pass an HF causal LM (AutoModelForCausalLM) or extend find_decoder_layers"
    )


def _find_final_norm(decoder: nn.Module) -> nn.Module | None:
    for name in _FINAL_NORM_NAMES:
        mod = getattr(decoder, name, None)
        if isinstance(mod, nn.Module):
            return mod
    return None


def _first_tensor(output: Any) -> torch.Tensor:
    # transformers 5.x decoder layers return a tensor; older / other models return a tuple.
    return output[0] if isinstance(output, (tuple, list)) else output


class _FrozenHeads(nn.Module):
    """What every frozen target exposes to the drafter: ``embed_tokens`` and ``lm_head``
    (set as ``_embed_tokens`` / ``_lm_head`` by the subclass), their device and dtype, and
    an eval mode that stays on whatever Lightning asks."""

    def train(self, mode: bool = True):
        """Always stay in eval mode (dropout off)."""
        return super().train(False)

    @property
    def embed_tokens(self) -> nn.Module:
        """The target's input embedding (frozen; shared with the drafter, not its parameter)."""
        return self._embed_tokens

    @property
    def lm_head(self) -> nn.Module:
        """The raw output projection hidden -> logits (no final norm: the drafter applies its own)."""
        return self._lm_head

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype


class FrozenTarget(_FrozenHeads):
    """A frozen HF causal LM that returns the hidden states of ``layer_ids`` (and logits).

    Parameters never require grad, the model stays in eval mode (``train()`` is a no-op) and
    ``forward`` runs under ``torch.no_grad()``. ``embed_tokens`` and ``lm_head`` are exposed
    for the drafter, which calls them with grad enabled for its own inputs (weights frozen).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]) -> None:
        super().__init__()
        self.model = model
        self.cache_kw = cache_kwarg(model)
        decoder, layers = find_decoder_layers(model)
        # Plain attributes, not submodules: they already live inside self.model, and registering
        # them again would duplicate every weight under a second name in state_dict().
        self.__dict__["_decoder"] = decoder
        self.__dict__["_layers"] = layers
        cfg = getattr(model, "config", None)
        self.config = text_config(cfg)
        n_cfg = getattr(self.config, "num_hidden_layers", None)
        # Some models append extra (e.g. MTP) layers beyond num_hidden_layers and never run them.
        self.num_layers = min(len(self._layers), n_cfg) if n_cfg else len(self._layers)
        self.layer_ids = self._validate_layer_ids(layer_ids)
        self.__dict__["_final_norm"] = _find_final_norm(decoder)
        if self.num_layers - 1 in self.layer_ids and self._final_norm is None:
            raise ValueError(
                f"layer id {self.num_layers - 1} (the last layer) means HF hidden_states[-1], the "
                f"final-norm output, but no final norm ({'/'.join(_FINAL_NORM_NAMES)}) was found "
                f"on {type(self._decoder).__name__}; use ids < {self.num_layers - 1}"
            )
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head)")
        self.__dict__["_embed_tokens"] = embed
        self.__dict__["_lm_head"] = head
        self.hidden_size = int(self.embed_tokens.weight.shape[1])
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.requires_grad_(False)
        super().train(False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        layer_ids: list[int],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        **model_kwargs: Any,
    ) -> FrozenTarget:
        """Load ``AutoModelForCausalLM`` from ``path`` (HF dir or hub id) and wrap it.

        Extra keyword arguments (e.g. ``attn_implementation``) go to ``from_pretrained``.
        """
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **model_kwargs)
        return cls(model.to(device), layer_ids)

    def _validate_layer_ids(self, layer_ids: list[int]) -> list[int]:
        raw = list(layer_ids)
        n = self.num_layers
        if not raw:
            raise ValueError(f"layer_ids is empty; give at least one id in 0..{n - 1}")
        bad_type = [i for i in raw if isinstance(i, bool) or not hasattr(i, "__index__")]
        if bad_type:
            raise ValueError(f"layer_ids={raw}: {bad_type} are not integers")
        ids = [operator.index(i) for i in raw]  # accepts numpy / torch integer scalars too
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"layer_ids={ids} lists {dupes} more than once; list each layer once")
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(
                f"layer_ids={ids}: {bad} out of range for a target with {n} decoder layers "
                f"(valid 0..{n - 1}; id i = output of decoder layer i = HF hidden_states[i+1])"
            )
        return ids

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        need_logits: bool = True,
        **model_kwargs: Any,
    ) -> TargetOutput:
        """Run the target on ``input_ids`` ``[B, S]`` and capture the ``layer_ids`` outputs.

        Without ``need_logits`` (and without a cache) the forward stops right after the deepest
        requested layer. ``model_kwargs`` (e.g. ``position_ids``, ``use_cache``, a cache) go to
        the HF model unchanged.
        """
        last = self.num_layers - 1
        captured: dict[int, torch.Tensor] = {}
        deepest = max(self.layer_ids)
        use_cache = bool(model_kwargs.pop("use_cache", False))
        if "cache" in model_kwargs:  # the model's own name for it (renamed in transformers 5.24)
            model_kwargs[self.cache_kw] = model_kwargs.pop("cache")
        # A partial forward would leave a half-filled cache behind: only stop early without one.
        stop_early = not need_logits and not use_cache and deepest < last

        def make_hook(layer_id: int):
            def hook(_module: nn.Module, _args: Any, output: Any) -> None:
                captured[layer_id] = _first_tensor(output)
                if stop_early and layer_id == deepest:
                    raise _StopForward

            return hook

        handles = []
        for i in self.layer_ids:
            # id L-1 = HF hidden_states[L], which HF ties to the final-norm output.
            module = self._final_norm if i == last else self._layers[i]
            handles.append(module.register_forward_hook(make_hook(i)))
        logits = None
        cache = None
        kwargs = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=use_cache,
            output_hidden_states=False,
            **model_kwargs,
        )
        try:
            if need_logits:
                out = self.model(**kwargs)
                logits = out.logits
            else:
                # The base model skips the lm_head (a [B, S, V] tensor we do not need).
                out = self.model.base_model(**kwargs)
            if use_cache:
                # transformers 5.24 renamed past_key_values -> cache; read either (no truthiness:
                # an empty cache has len 0).
                cache = getattr(out, "cache", None)
                if cache is None:
                    cache = getattr(out, "past_key_values", None)
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        missing = [i for i in self.layer_ids if i not in captured]
        if missing:
            raise RuntimeError(
                f"layers {missing} of {type(self.model).__name__} were not run during the forward; "
                "the decoder layer list found does not match what the model executes"
            )
        layers = [captured[i] for i in self.layer_ids]
        hidden = torch.cat(layers, dim=-1) if len(layers) > 1 else layers[0]
        # Views into `hidden`: the per-layer list costs no extra memory once `captured` is freed.
        views = list(hidden.split(self.hidden_size, dim=-1)) if len(layers) > 1 else [hidden]
        return TargetOutput(hidden=hidden, logits=logits, layers=views, cache=cache)

    def extra_repr(self) -> str:
        return (
            f"layer_ids={self.layer_ids}, num_layers={self.num_layers}, "
            f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}"
        )


class TargetHeads(_FrozenHeads):
    """The two pieces of a target a drafter needs when its features are cached: the frozen
    ``embed_tokens`` and ``lm_head``. The decoder layers are never loaded (``forward`` raises).

    Exposes the attributes the training module reads from a ``FrozenTarget``.
    """

    def __init__(self, embed: nn.Embedding, lm_head: nn.Linear, num_layers: int,
                 layer_ids: list[int]) -> None:
        super().__init__()
        self.__dict__["_embed_tokens"] = embed
        self.__dict__["_lm_head"] = lm_head
        self._mods = nn.ModuleList([embed, lm_head])  # so .to() moves both
        self.num_layers = int(num_layers)
        self.layer_ids = list(layer_ids)
        self.hidden_size = int(embed.weight.shape[1])
        self.vocab_size = int(lm_head.weight.shape[0])
        self.requires_grad_(False)
        super().train(False)

    @classmethod
    def from_model(cls, model: nn.Module, layer_ids: list[int]) -> TargetHeads:
        t = FrozenTarget(model, layer_ids)
        return cls(t.embed_tokens, t.lm_head, t.num_layers, t.layer_ids)

    @classmethod
    def from_pretrained(cls, path: str | Path, layer_ids: list[int],
                        dtype: torch.dtype = torch.float32) -> TargetHeads:
        """Read only the embedding and output matrices from an HF dir's safetensors."""
        from transformers import AutoConfig

        cfg = text_config(AutoConfig.from_pretrained(str(path)))
        found: dict[str, torch.Tensor] = {}
        for k, t in read_safetensors(path, lambda k: k.endswith(("embed_tokens.weight",
                                                                   "lm_head.weight"))).items():
            if k.endswith("embed_tokens.weight"):
                found.setdefault("embed", t)
            else:
                found["head"] = t
        if "embed" not in found:
            raise ValueError(f"target.path={path}: no *embed_tokens.weight in its safetensors")
        if "head" not in found:
            if not getattr(cfg, "tie_word_embeddings", False):
                raise ValueError(f"target.path={path}: no lm_head.weight and the embeddings "
                                 "are not tied")
            found["head"] = found["embed"]
        emb = nn.Embedding(*found["embed"].shape, _weight=found["embed"].to(dtype))
        head = nn.Linear(found["head"].shape[1], found["head"].shape[0], bias=False)
        head.weight = nn.Parameter(found["head"].to(dtype)) if found["head"] is not found[
            "embed"] else emb.weight
        layers = int(cfg.num_hidden_layers)
        bad = [i for i in layer_ids if not 0 <= int(i) < layers]
        if bad:
            raise ValueError(f"layer_ids {bad} out of range for a target with {layers} layers")
        return cls(emb, head, layers, layer_ids)

    def forward(self, *args: Any, **kwargs: Any) -> TargetOutput:
        raise RuntimeError("this target was loaded without its decoder layers (features=cache): "
                           "its features come from the cache, not from a forward")


def cache_kwarg(model: nn.Module) -> str:
    """The keyword ``model.forward`` takes its KV cache by: transformers 5.24 renamed
    ``past_key_values`` to ``cache`` (vLLM's CPU build pins transformers < 5.20)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def read_safetensors(path: str | Path, want) -> dict[str, torch.Tensor]:
    """The tensors of an HF dir's safetensors whose names ``want(name)`` accepts, opening only
    the shards that hold them when the checkpoint is sharded."""
    import json

    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():
        wmap = json.loads(index.read_text())["weight_map"]
        files = sorted({Path(path) / f for k, f in wmap.items() if want(k)})
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if want(k):
                    out[k] = st.get_tensor(k)
    return out


def target_layer_weights(path: str | Path, layer: int) -> dict[str, torch.Tensor]:
    """Decoder layer ``layer`` of an HF dir as ``{name under the layer: tensor}`` (e.g.
    ``self_attn.q_proj.weight``), plus the final norm as ``final_norm.weight``."""
    prefix = f"layers.{int(layer)}."
    out = {}
    for k, t in read_safetensors(path, lambda k: prefix in k or k.endswith("model.norm.weight")
                                 ).items():
        out[k.split(prefix, 1)[1] if prefix in k else "final_norm.weight"] = t
    return out


def load_final_norm(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The final norm of the HF model at ``path``, with its weights, and nothing else loaded.

    The model's own norm class runs (RMSNorm, the zero-centred ``1 + w`` variant of hybrids,
    LayerNorm): the skeleton is built on the meta device, the norm found as ``FrozenTarget``
    finds it, and only its tensors are read from the safetensors.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    decoder, _ = find_decoder_layers(skeleton)
    norm = _find_final_norm(decoder)
    if norm is None:
        raise ValueError(f"target.path={path}: no final norm ({'/'.join(_FINAL_NORM_NAMES)}) on "
                         f"{type(decoder).__name__}")
    name = next(n for n, m in skeleton.named_modules() if m is norm)
    leaf = name.rsplit(".", 1)[-1]  # e.g. "norm"; checkpoints may prefix the decoder otherwise
    found = read_safetensors(path, lambda k: k.startswith(name + ".") or (
        "layers." not in k and k.rsplit(".", 2)[-2:-1] == [leaf]))
    state = {}
    for param, _ in norm.named_parameters():
        hit = [k for k in found if k == f"{name}.{param}"] or [
            k for k in found if k.endswith(f".{leaf}.{param}")]
        if len(hit) != 1:
            raise ValueError(f"target.path={path}: {len(hit)} tensors named like {name}.{param} "
                             "in its safetensors, expected one")
        state[param] = found[hit[0]]
    norm = norm.to_empty(device="cpu")
    norm.load_state_dict(state)
    return norm.to(dtype).requires_grad_(False).eval()
