"""Greedy speculative decoding against an HF causal LM target (batch 1, lossless).

State between steps: ``tokens`` = prompt + committed output. The last committed token has not
been through the target yet (it is the previous step's bonus), so the target cache holds
positions 0 .. n-2 and the drafter's cache holds the context features of those same positions.
Each step drafts from the block ``[tokens[-1], m, ..., m]`` anchored at position n-1 (the
drafter sees context < n-1, only [n-1-w, n-1) with a sliding window w: the drafter's unmasked
cached call applies it; docs/ARCHITECTURE.md §2), verifies in one target forward and commits the
accepted drafts plus the target's bonus token. The per-step acceptance length
τ = tokens committed by the step = accepted drafts + 1 (≤ Bs); the first output token comes
from the prefill and belongs to no step, so ``sum(τ) + 1 == len(tokens)``.

Methods:
- ``target_greedy``: the reference, one token per KV-cached forward.
- ``chain_generate``: DFlash block drafter, chain verification (argmax per slot).
- ``tree_generate``: DDTree over the block's per-slot top-k, verified in one forward with an
  ancestor-only 4D mask; only the accepted path's K/V are kept.
- ``ngram_generate``: prompt-lookup drafting (vLLM's rule by default), chain verification.
- ``suffix_generate``: suffix decoding as vLLM runs it (``suffix_engine``: arctic-inference's
  cache, one path per step), chain verification.
- ``suffix_tree_generate``: the project's tree-shaped suffix decoding (``model_free``), tree
  verification.
- ``hybrid_generate``: per step the suffix draft when its score (expected accepted tokens
  under its counts, calibrated by its record in the request) reaches the drafter's mean
  accepted tokens so far in the request, else
  the drafter's DDTree (the suffix step skips the drafter's forward); ``merge=True`` instead
  merges both trees into one within the node budget every step.

Drafts are capped so a step never commits past ``max_new_tokens``; output is cut after the
first EOS. Targets whose cache cannot roll back (Gated DeltaNet recurrent state) run the chain
methods by recomputing the whole sequence each step (slow, still lossless); trees need a KV
cache (and an attention that honours a 4D mask: sdpa or eager).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lit.eval.ddtree import (
    accepted_path,
    build_ddtree,
    tree_attention_mask,
    tree_position_ids,
)
from dflash_lit.eval.model_free import SuffixIndex, merge_trees, ngram_propose, suffix_draft
from dflash_lit.eval.suffix_engine import EngineSuffix
from dflash_lit.eval.target_runner import (
    MASK_CAPABLE_ATTN,
    TargetRunner,
    cache_length,
    drop_last,
    is_rollbackable,
    keep_tail_rows,
)
from dflash_lit.eval.verify_cost import Trimmer, chain_path_probs
from dflash_lit.model.drafter import DFlashDrafter, DrafterCache


# --------------------------------------------------------------------------- results
@dataclass
class GenerationResult:
    """Output and acceptance statistics of one generation.

    tokens: generated ids (prompt excluded), cut at max_new_tokens and after the first EOS.
    acceptance_lengths: τ of every speculative step (empty for ``target_greedy``).
    slot_accepts[k]: steps in which draft slot k+1 (depth k+1 for trees) was accepted.
    slot_attempts[k]: steps in which slot k+1 could be verified (token budget permitting).
    draft_lengths: drafted tokens verified per step (tree: nodes, root excluded).
    """

    method: str
    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)
    slot_accepts: list[int] = field(default_factory=list)
    slot_attempts: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    wall_time: float = 0.0
    target_forwards: int = 0
    recomputed: bool = False  # the target cache could not roll back: full recompute per step

    @property
    def num_steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_tau(self) -> float:
        n = self.num_steps
        return sum(self.acceptance_lengths) / n if n else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_time if self.wall_time > 0 else float("nan")

    def slot_accept_rate(self) -> list[float]:
        return [a / t if t else float("nan") for a, t in zip(self.slot_accepts, self.slot_attempts)]


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------- drafter interface
@runtime_checkable
class BlockProposer(Protocol):
    """What chain/tree generation needs from a block drafter.

    ``layer_ids``: target layers whose outputs the drafter uses as context (None = none).
    ``observe(hidden)`` receives the context features [1, c, K*d] of newly committed tokens, in
    order (None when ``layer_ids`` is None). ``draft_logits(tokens)`` returns the logits
    [Bs-1, V] of slots 1..Bs-1, i.e. of positions len(tokens) .. len(tokens)+Bs-2.
    """

    block_size: int
    layer_ids: list[int] | None

    def reset(self) -> None: ...

    def observe(self, hidden: Tensor | None) -> None: ...

    def draft_logits(self, tokens: list[int]) -> Tensor: ...


class DFlashProposer:
    """A ``DFlashDrafter`` + the target's frozen ``embed_tokens`` / ``lm_head`` as a proposer.

    Keeps committed context K/V in a ``DrafterCache``; each draft feeds only the features of
    tokens committed since the previous draft. ``block_size`` may override the trained one.
    ``draft_vocab`` (sorted token ids) restricts the head to those rows of the lm_head, as
    EAGLE-3's draft vocabulary does: logits of every other id are -inf, so they are never
    drafted, and the head's matmul shrinks by vocab / len(draft_vocab).
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        block_size: int | None = None,
        draft_vocab: Tensor | None = None,
    ) -> None:
        self.drafter = drafter.eval()
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.vocab_size = int(lm_head.weight.shape[0])
        self.draft_ids = None if draft_vocab is None else draft_vocab.to(lm_head.weight.device)
        if self.draft_ids is not None:
            ids = self.draft_ids
            if ids.ndim != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
                raise ValueError(f"draft_vocab: {len(ids)} ids must lie in [0, {self.vocab_size})")
            self.draft_weight = lm_head.weight.detach()[ids].contiguous()
            bias = getattr(lm_head, "bias", None)
            self.draft_bias = None if bias is None else bias.detach()[ids]
        bs = int(block_size or drafter.config.block_size)
        if bs < 2:
            raise ValueError(f"block_size={bs}: a block needs the anchor plus >= 1 drafted slot")
        self.block_size = bs
        self.mask_token_id = drafter.config.mask_token_id
        self.layer_ids = list(drafter.config.target_layer_ids)
        p = next(drafter.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.reset()

    def reset(self) -> None:
        self.cache = DrafterCache()
        self._pending: list[Tensor] = []

    def observe(self, hidden: Tensor | None) -> None:
        if hidden is None:
            raise ValueError("DFlashProposer needs the target's context features (got None)")
        self._pending.append(hidden)

    @torch.no_grad()
    def draft_logits(self, tokens: list[int]) -> Tensor:
        n = len(tokens)
        k_d = self.drafter.fc.in_features
        if self._pending:
            new = torch.cat(self._pending, dim=1).to(device=self.device, dtype=self.dtype)
        else:
            new = torch.zeros(1, 0, k_d, device=self.device, dtype=self.dtype)
        c0 = self.cache.length
        if c0 + new.shape[1] != n - 1:
            raise RuntimeError(
                f"drafter context holds {c0 + new.shape[1]} positions, expected {n - 1} "
                "(every committed token but the last): observe() calls are out of step"
            )
        block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long)
        block[0, 0] = tokens[-1]
        emb = self.embed_tokens(block.to(self.embed_tokens.weight.device))
        pos = torch.cat([torch.arange(c0, n - 1), torch.arange(n - 1, n - 1 + self.block_size)])
        h = self.drafter(
            noise_embedding=emb.to(device=self.device, dtype=self.dtype),
            target_hidden=new,
            position_ids=pos[None].to(self.device),
            cache=self.cache,
        )
        self._pending = []
        w = self.lm_head.weight
        h = h[0, 1:].to(device=w.device, dtype=w.dtype)
        if self.draft_ids is None:
            return self.lm_head(h).float()
        sub = F.linear(h, self.draft_weight, self.draft_bias).float()
        out = sub.new_full((sub.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.draft_ids, sub)


def as_proposer(
    drafter: DFlashDrafter | BlockProposer, runner: TargetRunner, block_size: int | None,
    draft_vocab: Tensor | None = None,
) -> BlockProposer:
    if isinstance(drafter, DFlashDrafter):
        return DFlashProposer(drafter, runner.embed_tokens, runner.lm_head, block_size, draft_vocab)
    if not isinstance(drafter, BlockProposer):
        raise TypeError(
            f"drafter must be a DFlashDrafter or implement BlockProposer, got {type(drafter).__name__}"
        )
    return drafter


# --------------------------------------------------------------------------- shared decode state
def _eos_set(eos_ids: int | Iterable[int] | None) -> set[int]:
    if eos_ids is None:
        return set()
    if isinstance(eos_ids, int):
        return {eos_ids}
    return {int(e) for e in eos_ids}


def _prompt_list(prompt_ids: Sequence[int] | Tensor) -> list[int]:
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.dim() == 2:
            if prompt_ids.shape[0] != 1:
                raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)}: batch size 1 only")
            prompt_ids = prompt_ids[0]
        prompt_ids = prompt_ids.tolist()
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids is empty: the target needs at least one prompt token")
    return ids


def _check_max_new(max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Decode:
    """Committed tokens + target cache + stop rules shared by every speculative method."""

    def __init__(
        self,
        runner: TargetRunner,
        prompt: list[int],
        max_new_tokens: int,
        eos: set[int],
        slots: int,
        method: str,
        observe,
    ) -> None:
        self.runner, self.prompt, self.max_new, self.eos = runner, prompt, max_new_tokens, eos
        self.observe = observe
        self.result = GenerationResult(
            method=method, tokens=[], slot_accepts=[0] * slots, slot_attempts=[0] * slots
        )
        self.slots = slots
        self.done = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.result.tokens

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.result.tokens)

    def prefill(self) -> None:
        p = len(self.prompt)
        out = self.runner.forward(self.prompt, torch.arange(p), cache=None)
        self.cache = out.cache
        self.recompute = not is_rollbackable(self.cache)
        self.result.recomputed = self.recompute
        if self.recompute:
            self.cache = None  # recurrent state cannot roll back: recompute from scratch
        self.result.target_forwards += 1
        self.observe(out.hidden)
        self.step_tokens = [int(out.logits[-1].argmax())]
        self._emit(self.step_tokens)

    def _emit(self, new: list[int]) -> int:
        """Append tokens, cutting after the first EOS and at ``max_new_tokens``; returns how
        many were kept."""
        kept = []
        for t in new[: self.remaining]:
            kept.append(t)
            if t in self.eos:
                self.done = True
                break
        self.result.tokens.extend(kept)
        if self.remaining <= 0:
            self.done = True
        return len(kept)

    def verify_chain(self, drafts: list[int]) -> tuple[int, int]:
        """Verify ``drafts`` after the last token in one forward; commit; return (a, τ)."""
        n = len(self.tokens)
        if self.recompute:
            seq = self.tokens + drafts
            out = self.runner.forward(seq, torch.arange(len(seq)), cache=None, use_cache=False)
            q = len(drafts) + 1
            logits = out.logits[-q:]
            hidden = out.hidden[:, -q:] if out.hidden is not None else None
        else:
            out = self.runner.forward(
                [self.tokens[-1]] + drafts, torch.arange(n - 1, n + len(drafts)), cache=self.cache
            )
            self.cache, logits, hidden = out.cache, out.logits, out.hidden
        self.result.target_forwards += 1
        choice = logits.argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == choice[a]:
            a += 1
        if not self.recompute:
            drop_last(self.cache, len(drafts) - a)  # keep the root + a accepted drafts
        self.observe(hidden[:, : a + 1] if hidden is not None else None)
        self.step_tokens = drafts[:a] + [choice[a]]  # before the cut at EOS / max_new_tokens
        tau = self._emit(self.step_tokens)
        self._record(min(a, tau), tau, len(drafts))
        return a, tau

    def _record(self, accepted: int, tau: int, drafted: int) -> None:
        r = self.result
        verifiable = min(self.slots, self.remaining + tau - 1)
        for k in range(verifiable):
            r.slot_attempts[k] += 1
        for k in range(accepted):
            r.slot_accepts[k] += 1
        r.acceptance_lengths.append(tau)
        r.draft_lengths.append(drafted)


def _run(state: _Decode, step) -> GenerationResult:
    _sync(state.runner.device)
    t0 = time.perf_counter()
    state.prefill()
    while not state.done:
        step(state)
    _sync(state.runner.device)
    state.result.wall_time = time.perf_counter() - t0
    return state.result


# --------------------------------------------------------------------------- public API
@torch.no_grad()
def target_greedy(
    target: nn.Module,
    prompt_ids: Sequence[int] | Tensor,
    max_new_tokens: int,
    eos_ids: int | Iterable[int] | None = None,
) -> GenerationResult:
    """Reference greedy decode: one KV-cached target forward per token."""
    _check_max_new(max_new_tokens)
    runner = target if isinstance(target, TargetRunner) else TargetRunner(target)
    prompt = _prompt_list(prompt_ids)
    eos = _eos_set(eos_ids)
    res = GenerationResult(method="baseline", tokens=[])
    _sync(runner.device)
    t0 = time.perf_counter()
    out = runner.forward(prompt, torch.arange(len(prompt)), cache=None)
    cache = out.cache
    tok = int(out.logits[-1].argmax())
    res.tokens.append(tok)
    res.target_forwards = 1
    while tok not in eos and len(res.tokens) < max_new_tokens:
        pos = len(prompt) + len(res.tokens) - 1
        out = runner.forward([tok], torch.tensor([pos]), cache=cache)
        cache = out.cache
        tok = int(out.logits[-1].argmax())
        res.tokens.append(tok)
        res.target_forwards += 1
    _sync(runner.device)
    res.wall_time = time.perf_counter() - t0
    return res


@torch.no_grad()
def chain_generate(
    target: nn.Module,
    drafter: DFlashDrafter | BlockProposer,
    prompt_ids: Sequence[int] | Tensor,
    max_new_tokens: int,
    eos_ids: int | Iterable[int] | None = None,
    block_size: int | None = None,
    draft_vocab: Tensor | None = None,
    trimmer: Trimmer | None = None,
) -> GenerationResult:
    """Speculative decoding with chain verification of the drafter's per-slot argmax
    (over ``draft_vocab`` when given: ``DFlashProposer``); ``trimmer`` keeps, per step, the
    prefix of the chain worth its verify cost on this machine (``verify_cost``)."""
    _check_max_new(max_new_tokens)
    proposer, runner = _setup(target, drafter, block_size, draft_vocab)
    slots = proposer.block_size - 1

    def step(st: _Decode) -> None:
        t0 = time.perf_counter()
        logits = proposer.draft_logits(st.tokens)[: min(slots, st.remaining - 1)]
        drafts = logits.argmax(-1).tolist()
        if trimmer is None:
            st.verify_chain(drafts)
            return
        probs = chain_path_probs(logits)
        n = trimmer.choose(probs, time.perf_counter() - t0)
        a, _ = st.verify_chain(drafts[:n])
        trimmer.record(a, sum(probs[:n]))

    st = _Decode(runner, _prompt_list(prompt_ids), max_new_tokens, _eos_set(eos_ids), slots,
                 "chain", proposer.observe)
    return _run(st, step)


@torch.no_grad()
def ngram_generate(
    target: nn.Module,
    prompt_ids: Sequence[int] | Tensor,
    max_new_tokens: int,
    eos_ids: int | Iterable[int] | None = None,
    block_size: int = 16,
    n_max: int = 3,
    n_min: int = 1,
    rule: str = "earliest",
) -> GenerationResult:
    """Prompt-lookup (n-gram) drafting of up to ``block_size - 1`` tokens, chain verification.
    ``rule``: which earlier occurrence of the matched n-gram drafts (``model_free.ngram_propose``)."""
    _check_max_new(max_new_tokens)
    if block_size < 2:
        raise ValueError(f"block_size={block_size}: need >= 2 (anchor + at least one draft)")
    runner = target if isinstance(target, TargetRunner) else TargetRunner(target)
    slots = block_size - 1

    def step(st: _Decode) -> None:
        st.verify_chain(ngram_propose(st.tokens, min(slots, st.remaining - 1), n_max, n_min, rule))

    st = _Decode(runner, _prompt_list(prompt_ids), max_new_tokens, _eos_set(eos_ids), slots,
                 "ngram", lambda hidden: None)
    return _run(st, step)


@torch.no_grad()
def tree_generate(
    target: nn.Module,
    drafter: DFlashDrafter | BlockProposer,
    prompt_ids: Sequence[int] | Tensor,
    max_new_tokens: int,
    budget: int,
    eos_ids: int | Iterable[int] | None = None,
    block_size: int | None = None,
    top_k: int | None = None,
    draft_vocab: Tensor | None = None,
    trimmer: Trimmer | None = None,
) -> GenerationResult:
    """Speculative decoding with DDTree verification (``budget`` nodes, root excluded;
    ``trimmer``: only the best-first prefix worth its verify cost, ``verify_cost``).

    Per-slot top-k (k = ``top_k`` or min(budget, V)) log-probs of one draft block build a
    best-first tree; the target verifies root + nodes in one forward with an ancestor-only
    mask over [cache ; tree] at positions start + depth; the target's greedy choice is walked
    from the root; only the accepted path's K/V are kept (compacted in place, then cropped).
    """
    _check_max_new(max_new_tokens)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"tree budget={budget!r}: the node budget (root excluded) must be an int >= 1")
    proposer, runner = _setup(target, drafter, block_size, draft_vocab)
    if runner.attn_implementation not in MASK_CAPABLE_ATTN:
        raise ValueError(
            f"tree verification passes a custom 4D mask, which attn_implementation="
            f"{runner.attn_implementation!r} ignores; load the target with one of {MASK_CAPABLE_ATTN}"
        )
    slots = proposer.block_size - 1

    def step(st: _Decode) -> None:
        if st.recompute:
            raise NotImplementedError(
                "tree verification needs a KV cache that can drop rejected branches; this target's "
                "cache has recurrent (e.g. Gated DeltaNet) layers. Use method chain for it."
            )
        depth = min(slots, st.remaining - 1)
        if depth == 0:
            st.verify_chain([])
            return
        t0 = time.perf_counter()
        tree = _draft_ddtree(proposer, st.tokens, depth, budget, top_k)
        _verify_trimmed(st, tree, trimmer, time.perf_counter() - t0)

    st = _Decode(runner, _prompt_list(prompt_ids), max_new_tokens, _eos_set(eos_ids), slots,
                 f"tree_b{budget}", proposer.observe)
    return _run(st, step)


def _draft_ddtree(proposer: BlockProposer, tokens: list[int], depth: int, budget: int,
                  top_k: int | None) -> Any:
    """The DDTree of ``budget`` nodes over the first ``depth`` slots of the drafter's block
    (per-slot top-k, k = ``top_k`` or min(budget, V))."""
    logits = proposer.draft_logits(tokens)[:depth]
    k = min(top_k or budget, logits.shape[-1])
    lp, ids = F.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return build_ddtree(lp.cpu(), ids.cpu(), budget)


def _verify_tree(st: _Decode, tree: Any) -> int:
    """Verify ``tree`` in one target forward, commit the accepted path + bonus; returns the
    number of accepted nodes."""
    runner = st.runner
    n = len(st.tokens)
    past = cache_length(st.cache)
    q = tree.num_nodes + 1
    allowed = torch.cat([torch.ones(q, past, dtype=torch.bool), tree_attention_mask(tree)], dim=1)
    out = runner.forward(
        [st.tokens[-1]] + tree.token_ids.tolist(),
        tree_position_ids(tree, n - 1),
        cache=st.cache,
        attention_mask=runner.additive_mask(allowed),
    )
    st.cache = out.cache
    st.result.target_forwards += 1
    choice = out.logits.argmax(-1).tolist()
    path = accepted_path(tree, choice)
    rows = [0] + [p + 1 for p in path]
    keep_tail_rows(st.cache, past, rows)  # drop rejected branches, keep root + accepted path
    st.observe(out.hidden[:, rows] if out.hidden is not None else None)
    st.step_tokens = tree.token_ids[path].tolist() + [choice[rows[-1]]]
    tau = st._emit(st.step_tokens)
    st._record(min(len(path), tau), tau, tree.num_nodes)
    return len(path)


def _verify_trimmed(st: _Decode, tree: Any, trimmer: Trimmer | None,
                    draft_s: float) -> tuple[int, float | None]:
    """Verify ``tree``, or with a ``trimmer`` its best prefix (none: a plain decoding step);
    returns (accepted nodes, the kept nodes' Σ path probability, None without a trimmer)."""
    pred = None
    if trimmer is not None:
        tree, pred = trimmer.trim(tree, draft_s)
    acc = _verify_tree(st, tree) if tree.num_nodes else st.verify_chain([])[0]
    if trimmer is not None:
        trimmer.record(acc, pred)
    return acc, pred


def _needs_kv_cache(st: _Decode, what: str) -> None:
    if st.recompute:
        raise NotImplementedError(
            f"{what} verifies a tree, which needs a KV cache that can drop rejected branches; "
            "this target's cache has recurrent (e.g. Gated DeltaNet) layers. Use chain or ngram."
        )


@torch.no_grad()
def suffix_generate(
    target: nn.Module,
    prompt_ids: Sequence[int] | Tensor,
    max_new_tokens: int,
    eos_ids: int | Iterable[int] | None = None,
    engine: EngineSuffix | None = None,
    request_id: str = "0",
) -> GenerationResult:
    """Suffix decoding as vLLM's method ``suffix`` runs it: per step one drafted path from
    ``engine`` (the prompt tree and the global tree of responses served by the same engine;
    a fresh one when None), chain verification. Like the engine, the cache receives each
    step's whole accepted tokens, past EOS or ``max_new_tokens`` too, and the drafts are
    capped by ``num_speculative_tokens`` only."""
    _check_max_new(max_new_tokens)
    engine = engine or EngineSuffix()
    runner = target if isinstance(target, TargetRunner) else TargetRunner(target)
    prompt = _prompt_list(prompt_ids)
    engine.start(request_id, prompt)

    def step(st: _Decode) -> None:
        st.verify_chain(engine.propose(request_id, st.step_tokens, st.tokens))

    st = _Decode(runner, prompt, max_new_tokens, _eos_set(eos_ids), engine.settings.spec_tokens,
                 "suffix", lambda hidden: None)
    res = _run(st, step)
    engine.propose(request_id, st.step_tokens, st.tokens)  # the engine's call after the last step
    engine.stop(request_id)
    return res


@torch.no_grad()
def suffix_tree_generate(
    target: nn.Module,
    prompt_ids: Sequence[int] | Tensor,
    max_new_tokens: int,
    eos_ids: int | Iterable[int] | None = None,
    block_size: int = 16,
    budget: int = 16,
    global_index: SuffixIndex | None = None,
    depth: int = 32,
    min_prob: float = 0.1,
    trimmer: Trimmer | None = None,
) -> GenerationResult:
    """Tree-shaped suffix decoding: a draft tree (``budget`` nodes, ``block_size - 1`` deep) from the
    request's own suffix index and ``global_index`` (earlier outputs), verified in one pass
    (``trimmer``: its best-first prefix worth the verify cost, ``verify_cost``)."""
    _check_max_new(max_new_tokens)
    runner = target if isinstance(target, TargetRunner) else TargetRunner(target)
    slots = block_size - 1
    local = SuffixIndex(depth)
    indexes = [local] + ([global_index] if global_index is not None else [])

    def step(st: _Decode) -> None:
        _needs_kv_cache(st, "suffix_tree")
        local.extend(st.tokens[local.length:])
        d = min(slots, st.remaining - 1)
        t0 = time.perf_counter()
        tree, _ = suffix_draft(indexes, st.tokens, budget, d, min_prob) if d > 0 else (None, 0.0)
        if tree is None or tree.num_nodes == 0:
            st.verify_chain([])
        else:
            _verify_trimmed(st, tree, trimmer, time.perf_counter() - t0)

    st = _Decode(runner, _prompt_list(prompt_ids), max_new_tokens, _eos_set(eos_ids), slots,
                 "suffix_tree", lambda hidden: None)
    return _run(st, step)


@torch.no_grad()
def hybrid_generate(
    target: nn.Module,
    drafter: DFlashDrafter | BlockProposer,
    prompt_ids: Sequence[int] | Tensor,
    max_new_tokens: int,
    budget: int,
    eos_ids: int | Iterable[int] | None = None,
    block_size: int | None = None,
    top_k: int | None = None,
    global_index: SuffixIndex | None = None,
    merge: bool = False,
    depth: int = 32,
    min_prob: float = 0.1,
    draft_vocab: Tensor | None = None,
    suffix_slots: int | None = None,
    trimmer: Trimmer | None = None,
) -> GenerationResult:
    """Drafter + suffix decoding as a serving engine runs them, ``budget`` nodes per step.
    The suffix half drafts at most ``suffix_slots`` tokens deep (None: the drafter's block
    size - 1), independent of the drafter's block.

    ``merge=False`` (``hybrid``): the suffix tree when its score, calibrated by the suffix
    steps so far (accepted / predicted in this request), reaches the drafter's mean accepted
    tokens per step so far (1 before its first step), else the drafter's DDTree; a suffix step
    skips the drafter's forward. ``merge=True`` (``merged``):
    DDTree and suffix tree merged into one tree of ``budget`` nodes every step.
    ``trimmer``: each step verifies only the prefix worth its cost (``verify_cost``).
    """
    _check_max_new(max_new_tokens)
    proposer, runner = _setup(target, drafter, block_size, draft_vocab)
    slots = proposer.block_size - 1
    sfx_slots = slots if suffix_slots is None else int(suffix_slots)
    if sfx_slots < 1:
        raise ValueError(f"suffix_slots={suffix_slots}: the suffix draft needs >= 1 token")
    local = SuffixIndex(depth)
    indexes = [local] + ([global_index] if global_index is not None else [])
    drafter_steps = [1.0, 1]  # accepted nodes, steps (prior: one token per step)
    suffix_steps = [1.0, 1.0]  # accepted nodes, predicted scores (calibration, prior 1)

    def step(st: _Decode) -> None:
        _needs_kv_cache(st, "hybrid")
        local.extend(st.tokens[local.length:])
        d = min(slots, st.remaining - 1)
        if d == 0:
            st.verify_chain([])
            return
        t0 = time.perf_counter()
        sfx, score = suffix_draft(indexes, st.tokens, budget, min(sfx_slots, st.remaining - 1),
                                  min_prob)
        calibrated = score * suffix_steps[0] / suffix_steps[1]
        if not merge and sfx.num_nodes and calibrated >= drafter_steps[0] / drafter_steps[1]:
            acc, kept = _verify_trimmed(st, sfx, trimmer, time.perf_counter() - t0)
            suffix_steps[0] += acc
            suffix_steps[1] += score if kept is None else kept
            return
        tree = _draft_ddtree(proposer, st.tokens, d, budget, top_k)
        if merge:
            _verify_trimmed(st, merge_trees(tree, sfx, budget), trimmer, time.perf_counter() - t0)
            return
        drafter_steps[0] += _verify_trimmed(st, tree, trimmer, time.perf_counter() - t0)[0]
        drafter_steps[1] += 1

    name = f"{'merged' if merge else 'hybrid'}_b{budget}"
    st = _Decode(runner, _prompt_list(prompt_ids), max_new_tokens, _eos_set(eos_ids),
                 max(slots, sfx_slots), name, proposer.observe)
    return _run(st, step)


def _setup(
    target: nn.Module, drafter: DFlashDrafter | BlockProposer, block_size: int | None,
    draft_vocab: Tensor | None = None,
) -> tuple[BlockProposer, TargetRunner]:
    base = target.model if isinstance(target, TargetRunner) else target
    layer_ids = (
        list(drafter.config.target_layer_ids) if isinstance(drafter, DFlashDrafter)
        else getattr(drafter, "layer_ids", None)
    )
    runner = TargetRunner(base, layer_ids)
    proposer = as_proposer(drafter, runner, block_size, draft_vocab)
    if block_size is not None and not isinstance(drafter, DFlashDrafter):
        if proposer.block_size != block_size:
            raise ValueError(
                f"block_size={block_size} given but the proposer drafts blocks of {proposer.block_size}"
            )
    proposer.reset()
    return proposer, runner
