"""Speculative decoding: lossless vs the target's greedy decode, exact τ with oracle drafters."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_lit import DFlashConfig, DFlashDrafter
from dflash_lit.compat import check_compatible
from dflash_lit.errors import UserError
from dflash_lit.eval.model_free import SuffixIndex
from dflash_lit.eval.offline import offline_streak
from dflash_lit.eval.prompts import PromptSetError, load_prompts
from dflash_lit.eval.report import EvalSettings, check_lossless, run_evaluation
from dflash_lit.eval.speculative import (
    chain_generate,
    first_mismatch,
    hybrid_generate,
    ngram_generate,
    ngram_propose,
    suffix_generate,
    suffix_tree_generate,
    target_greedy,
    tree_generate,
)
from dflash_lit.eval.suffix_engine import EngineSuffix, SuffixSettings
from dflash_lit.tiny.random_targets import tiny_hybrid, tiny_qwen3

V, D, L, BS = 96, 32, 4, 4


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(vocab_size=V, hidden_size=D, num_layers=L, head_dim=8, intermediate_size=64,
                      seed=0)


def drafter_cfg(**kw) -> DFlashConfig:
    base = dict(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, num_hidden_layers=2, block_size=BS, mask_token_id=3,
                num_target_layers=L, target_layer_ids=[0, 2, 3], vocab_size=V)
    base.update(kw)
    return DFlashConfig(**base)


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(1)
    return DFlashDrafter(drafter_cfg()).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(4, V, (n,), generator=g).tolist() for n in (5, 11, 17)]


def naive_greedy(model, prompt, n):
    """No cache, full recompute per token: the obviously-right reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


class Oracle:
    """Test double with the BlockProposer interface: drafts the target's own greedy tokens.

    ``wrong_slots``: slots whose top-1 is a wrong token (logit 20) with the right one second
    (logit 15); every other slot puts logit 20 on the right token.
    """

    layer_ids = None

    def __init__(self, model, block_size=BS, wrong_slots=()):
        self.model, self.block_size, self.wrong = model, block_size, set(wrong_slots)
        self.calls = 0

    def reset(self):
        pass

    def observe(self, hidden):
        assert hidden is None

    def draft_logits(self, tokens):
        self.calls += 1
        cont = target_greedy(self.model, tokens, self.block_size - 1).tokens
        logits = torch.zeros(self.block_size - 1, V)
        for k, t in enumerate(cont):
            if k + 1 in self.wrong:
                logits[k, (t + 1) % V], logits[k, t] = 20.0, 15.0
            else:
                logits[k, t] = 20.0
        return logits


def test_target_greedy_matches_naive(target, prompts):
    for p in prompts:
        assert target_greedy(target, p, 20).tokens == naive_greedy(target, p, 20)


@pytest.mark.parametrize("method", ["chain", "tree4", "tree8", "ngram", "ngram_latest", "suffix",
                                    "suffix_tree", "hybrid", "merged"])
def test_lossless_random_drafter(target, drafter, prompts, method):
    index = SuffixIndex(8)  # a global cache of earlier outputs, as run_evaluation keeps one
    engine = EngineSuffix(SuffixSettings(max_tree_depth=8))  # vLLM's cache, shared likewise
    for n, p in enumerate(prompts):
        for max_new in (1, 2, 23):
            ref = target_greedy(target, p, max_new).tokens
            if method == "chain":
                r = chain_generate(target, drafter, p, max_new)
            elif method.startswith("ngram"):
                r = ngram_generate(target, p, max_new, block_size=BS,
                                   rule="latest" if method.endswith("latest") else "earliest")
            elif method == "suffix":
                r = suffix_generate(target, p, max_new, engine=engine, request_id=f"{n}-{max_new}")
            elif method == "suffix_tree":
                r = suffix_tree_generate(target, p, max_new, block_size=BS, budget=6,
                                         global_index=index, depth=8)
            elif method in ("hybrid", "merged"):
                r = hybrid_generate(target, drafter, p, max_new, budget=6, global_index=index,
                                    merge=method == "merged", depth=8)
            else:
                r = tree_generate(target, drafter, p, max_new, budget=int(method[4:]))
            assert r.tokens == ref, (method, p, first_mismatch(r.tokens, ref))
            assert len(r.tokens) == max_new
            assert sum(r.acceptance_lengths) + 1 == len(r.tokens)
            assert all(1 <= t <= (9 if method == "suffix" else BS) for t in r.acceptance_lengths)
            assert r.target_forwards == r.num_steps + 1
            index.extend(ref)
            index.end_sequence()


def test_draft_vocab_restricts_the_head_and_stays_lossless(target, drafter, prompts):
    """A draft vocabulary gives the full head's logits on its ids and -inf elsewhere (so the
    whole vocab as draft vocab changes nothing), and every drafter method stays lossless."""
    from dflash_lit.eval.speculative import DFlashProposer
    from dflash_lit.eval.target_runner import TargetRunner

    runner = TargetRunner(target, list(drafter.config.target_layer_ids))
    p = prompts[2]
    hidden = runner.forward(p, torch.arange(len(p))).hidden
    ids = torch.tensor([4, 9, 17, 40, 77, 95])
    logits = {}
    for name, vocab in (("full", None), ("all", torch.arange(V)), ("some", ids)):
        prop = DFlashProposer(drafter, runner.embed_tokens, runner.lm_head, draft_vocab=vocab)
        prop.observe(hidden[:, :-1])
        logits[name] = prop.draft_logits(p)
    assert torch.equal(logits["all"], logits["full"])
    torch.testing.assert_close(logits["some"][:, ids], logits["full"][:, ids])
    rest = torch.ones(V, dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(logits["some"][:, rest]).all()
    with pytest.raises(ValueError, match="draft_vocab"):
        DFlashProposer(drafter, runner.embed_tokens, runner.lm_head, draft_vocab=torch.tensor([V]))
    for q in prompts:
        ref = target_greedy(target, q, 23).tokens
        runs = [chain_generate(target, drafter, q, 23, draft_vocab=ids),
                tree_generate(target, drafter, q, 23, budget=6, draft_vocab=ids),
                hybrid_generate(target, drafter, q, 23, budget=6, merge=True, depth=8,
                                draft_vocab=ids)]
        for r in runs:
            assert r.tokens == ref, (r.method, first_mismatch(r.tokens, ref))


def test_model_free_methods_draft_their_own_depth_whatever_the_drafter_block(target, drafter,
                                                                            prompts):
    """n-gram and suffix decoding (and the suffix half of the hybrids) draft as deep as their
    own settings say, not the drafter's block - 1: a small-block drafter must not cap them."""
    s = EvalSettings(methods=["ngram", "suffix_tree", "merged", "hybrid"], budgets=[6],
                     max_new_tokens=24, ngram_tokens=6, suffix_tree_depth=5, warmup=False)
    rep = run_evaluation(target, drafter, [(f"p{i}", p) for i, p in enumerate(prompts)], s,
                         progress=False)
    m = rep["methods"]
    assert rep["lossless"] and rep["block_size"] == BS == 4
    assert len(m["ngram"]["slot_accepts"]) == 6 and len(m["suffix_tree"]["slot_accepts"]) == 5
    assert len(m["merged_b6"]["slot_accepts"]) == len(m["hybrid_b6"]["slot_accepts"]) == 5
    # a prompt that repeats itself: its first n-gram draft is as long as the setting allows
    loop = [("loop", list(range(10, 30)) + list(range(10, 13)))]
    drafted = {}
    for n in (3, 6):
        s = EvalSettings(methods=["ngram"], max_new_tokens=24, ngram_tokens=n, warmup=False)
        rep = run_evaluation(target, drafter, loop, s, progress=False)
        drafted[n] = rep["methods"]["ngram"]["mean_draft_length"] * rep["methods"]["ngram"]["steps"]
    assert drafted[6] - drafted[3] >= 3 - 1e-9
    with pytest.raises(UserError, match=r"suffix_tree.max_tree_depth=0"):
        EvalSettings(suffix_tree_depth=0).validate()


def test_perfect_drafter_chain_tau_is_block_size(target, prompts):
    for p in prompts:
        r = chain_generate(target, Oracle(target), p, 23)
        assert r.tokens == target_greedy(target, p, 23).tokens
        # 23 = 1 (prefill) + 5 full blocks of 4 + a last step capped at 2 tokens.
        assert r.acceptance_lengths == [BS] * 5 + [2]
        assert r.slot_accepts == [6, 5, 5] and r.slot_attempts == [6, 5, 5]


def test_tree_at_least_chain_and_recovers_rank2(target, prompts):
    """Oracle wrong at slot 2 (right token ranked 2nd): chain accepts 1 draft per step; a tree
    of budget Bs-1 is the chain itself; budget 4 adds the rank-2 depth-2 node; budget >= 5
    adds its child too and reaches τ = Bs."""
    p = prompts[1]
    ref = target_greedy(target, p, 25).tokens
    chain = chain_generate(target, Oracle(target, wrong_slots=[2]), p, 25)
    trees = {b: tree_generate(target, Oracle(target, wrong_slots=[2]), p, 25, budget=b)
             for b in (3, 4, 5, 8)}
    for r in [chain, *trees.values()]:
        assert r.tokens == ref
    assert chain.acceptance_lengths == [2] * 12
    assert trees[3].acceptance_lengths == chain.acceptance_lengths
    assert trees[4].acceptance_lengths == [3] * 8
    assert trees[5].acceptance_lengths == [4] * 6
    assert trees[8].acceptance_lengths == [4] * 6
    assert trees[8].draft_lengths[0] == 8
    taus = [chain.mean_tau] + [trees[b].mean_tau for b in (3, 4, 5, 8)]
    assert taus == sorted(taus)


def test_eos_stops_every_method(target, drafter, prompts):
    p = prompts[2]
    free = target_greedy(target, p, 30).tokens
    eos = free[6]
    cut = free.index(eos) + 1
    ref = target_greedy(target, p, 30, eos_ids=[eos])
    assert ref.tokens == free[:cut]
    oracle_chain = chain_generate(target, Oracle(target), p, 30, eos_ids=eos)
    assert oracle_chain.tokens == ref.tokens
    assert sum(oracle_chain.acceptance_lengths) + 1 == cut
    for r in (chain_generate(target, drafter, p, 30, eos_ids=[eos]),
              tree_generate(target, drafter, p, 30, budget=8, eos_ids=[eos]),
              ngram_generate(target, p, 30, eos_ids=[eos], block_size=BS)):
        assert r.tokens == ref.tokens


@pytest.mark.parametrize("window", [None, 6])
def test_offline_streak_matches_online_chain(target, prompts, window):
    """Teacher-forced streak at each anchor the online decode visited == drafts it accepted,
    also with a sliding window (training's masks vs the cached inference call)."""
    torch.manual_seed(1)
    drafter = DFlashDrafter(drafter_cfg(sliding_window=window)).eval()
    p = prompts[0]
    cont = target_greedy(target, p, 40).tokens
    online = chain_generate(target, drafter, p, 40)
    off = offline_streak(target, drafter, p, cont)
    by_anchor = dict(zip(off.anchors, off.streaks))
    assert off.anchors == list(range(len(p) - 1, len(p) + len(cont) - 1))
    n = len(p) + 1
    checked = 0
    for tau, drafted in zip(online.acceptance_lengths, online.draft_lengths):
        if drafted == BS - 1:  # not capped by max_new_tokens
            assert by_anchor[n - 1] == tau - 1, n
            checked += 1
        n += tau
    assert checked >= 10


def test_hybrid_target_chain_recomputes_losslessly():
    h = tiny_hybrid(vocab_size=V, hidden_size=D, num_layers=4, seed=3)
    torch.manual_seed(2)
    d = DFlashDrafter(drafter_cfg(target_layer_ids=[1, 3])).eval()
    p = list(range(10, 19))
    ref = target_greedy(h, p, 12).tokens
    r = chain_generate(h, d, p, 12)
    assert r.recomputed and r.tokens == ref
    assert ngram_generate(h, p, 12, block_size=BS).tokens == ref
    with pytest.raises(NotImplementedError, match="Gated DeltaNet"):
        tree_generate(h, d, p, 12, budget=4)


def test_tree_mask_with_cache_equals_sequential(target):
    """transformers 5.24 Qwen3 takes an additive 4D mask [1, 1, q, cache+q] with a cache as-is:
    each tree node's logits equal a plain causal forward over its own root path."""
    from dflash_lit.eval.ddtree import build_ddtree, tree_attention_mask, tree_position_ids
    from dflash_lit.eval.target_runner import TargetRunner

    runner = TargetRunner(target)
    ctx = list(range(10, 19))
    pre = runner.forward(ctx[:-1], torch.arange(8))
    g = torch.Generator().manual_seed(0)
    lp, ids = torch.randn(3, V, generator=g).log_softmax(-1).topk(4, dim=-1)
    tree = build_ddtree(lp, ids, budget=7)
    q = tree.num_nodes + 1
    allowed = torch.cat([torch.ones(q, 8, dtype=torch.bool), tree_attention_mask(tree)], dim=1)
    out = runner.forward([ctx[-1]] + tree.token_ids.tolist(), tree_position_ids(tree, 8),
                         cache=pre.cache, attention_mask=runner.additive_mask(allowed))
    assert pre.cache.get_seq_length() == 8 + q
    for i in range(tree.num_nodes):
        path, j = [], i
        while j >= 0:
            path.append(int(tree.token_ids[j]))
            j = int(tree.parents[j])
        seq = ctx + path[::-1]
        with torch.no_grad():
            ref = target(torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(out.logits[i + 1], ref, atol=1e-5, rtol=1e-5)


def test_ngram_propose_hand_computed():
    seq = [5, 6, 7, 8, 9, 5, 6, 7]
    assert ngram_propose(seq, 3) == [8, 9, 5]  # trigram 5 6 7 seen at 0
    assert ngram_propose([1, 2, 3, 1, 9, 9, 1], 2, rule="latest") == [9, 9]  # most recent earlier 1
    assert ngram_propose([1, 2, 3, 1, 9, 9, 1], 2) == [2, 3]  # vLLM: the earliest 1
    assert ngram_propose([1, 2, 3, 4], 5) == []
    assert ngram_propose(seq, 0) == []


def test_run_evaluation_report(target, drafter, prompts):
    s = EvalSettings(methods=["chain", "tree", "ngram"], budgets=[3, 8], max_new_tokens=12,
                     offline_streak=True, warmup=False)
    rep = run_evaluation(target, drafter, [(f"p{i}", p) for i, p in enumerate(prompts)], s,
                         progress=False)
    assert rep["lossless"] and rep["mismatches"] == []
    assert set(rep["methods"]) == {"baseline", "chain", "tree_b3", "tree_b8", "ngram"}
    chain = [t for row in rep["per_prompt"] for t in row["chain"]]
    assert rep["tau_chain"] == sum(chain) / len(chain)
    assert rep["methods"]["chain"]["tokens"] == 36
    assert set(rep["tau_tree"]) == {"3", "8"}
    assert rep["offline"]["blocks"] == 3 * 12  # one block per output token's anchor
    json.dumps(rep, allow_nan=False)
    check_lossless(rep)
    rep["mismatches"] = [{"prompt_id": "p1", "method": "chain", "position": 4,
                          "expected": 9, "got": 10}]
    with pytest.raises(RuntimeError, match="prompt p1: method chain differs .* position 4"):
        check_lossless(rep)


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(budgets=[4, 0]), "budget 0 is invalid"),
        (dict(methods=["chain", "beam"]), r"unknown \['beam'\]"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
    ],
)
def test_settings_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        EvalSettings(**kw).validate()


def test_bad_inputs(target, drafter, prompts):
    with pytest.raises(ValueError, match="budget=0"):
        tree_generate(target, drafter, prompts[0], 5, budget=0)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        chain_generate(target, drafter, prompts[0], 0)
    wide = DFlashDrafter(drafter_cfg(hidden_size=48))
    with pytest.raises(ValueError, match="drafter hidden_size=48 but target hidden size=32"):
        check_compatible(wide.config, target)
    deep = drafter_cfg(num_target_layers=8, target_layer_ids=[1, 6])
    with pytest.raises(ValueError, match=r"include \[6\], but the target has 4 decoder layers"):
        check_compatible(deep, target)
    with pytest.raises(ValueError, match="drafter vocab_size=128 but target vocab size=96"):
        check_compatible(drafter_cfg(vocab_size=128), target)
    with pytest.raises(PromptSetError, match="unknown prompt set 'mbpp'"):
        load_prompts("mbpp")


def test_prompt_sets(tmp_path):
    he = load_prompts("humaneval")
    assert len(he) == 164 and he[0].id == "HumanEval/0" and "def " in he[0].text
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "q": "hello"}\n\n{"q": [{"role": "user", "content": "hi"},'
                 ' {"role": "assistant", "content": "x"}]}\n{"q": 3}\n')
    with pytest.raises(PromptSetError, match=r"p\.jsonl:4: field 'q' must be a string"):
        load_prompts("jsonl", f, field="q")
    f.write_text('{"id": "a", "q": "hello"}\n{"q": "b"}\n{"nope": 1}\n')
    with pytest.raises(PromptSetError, match=r"p\.jsonl:3: no field 'q'"):
        load_prompts("jsonl", f, field="q")
    f.write_text('{"id": "a", "q": "hello"}\n{"q": [{"role": "user", "content": "hi"},'
                 ' {"role": "assistant", "content": "x"}]}\nnot json\n')
    with pytest.raises(PromptSetError, match=r"p\.jsonl:3: invalid JSON"):
        load_prompts("jsonl", f, field="q")
    f.write_text(f.read_text().replace("not json", '{"q": "c"}'))
    ps = load_prompts("jsonl", f, field="q", limit=2)
    assert [p.id for p in ps] == ["a", "p.jsonl:2"]
    assert ps[1].messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(PromptSetError, match="prompts_path"):
        load_prompts("jsonl")


def test_tiny_heldout_prompts():
    from dflash_lit.eval.prompts import TINY_HELDOUT, _tiny_path

    try:
        path = _tiny_path(None)
    except PromptSetError:
        pytest.skip(f"{TINY_HELDOUT} not built yet")
    ps = load_prompts("tiny_heldout", limit=5)
    rows = [json.loads(line) for line in path.read_text().splitlines()[:5]]
    assert [p.id for p in ps] == [r["id"] for r in rows]
    assert [p.text for p in ps] == [r["prompt"] for r in rows]
