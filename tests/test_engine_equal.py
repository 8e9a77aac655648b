"""The in-process model-free baselines equal vLLM's, draft for draft and step for step.

- n-gram: ``ngram_propose`` against vLLM's own numba kernel on random sequences;
- suffix decoding: ``EngineSuffix`` against vLLM's ``SuffixDecodingProposer`` driven through
  the same simulated decode;
- end to end: ``evaluate.py engine=vllm`` against the in-process evaluator on the tiny target
  with the shipped drafter: equal outputs and equal verify steps for every prompt.

vLLM is the project's ``engine`` extra; ``DFLASH_REQUIRE_ENGINE=1`` (set by CI) turns a
missing engine into a failure instead of a skip.
"""

from __future__ import annotations

import importlib
import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_lit.eval.model_free import ngram_propose
from dflash_lit.eval.suffix_engine import EngineSuffix, SuffixSettings

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = ROOT / "artifacts" / "tiny" / "drafter"


def _need(module: str):
    if os.environ.get("DFLASH_REQUIRE_ENGINE") == "1":
        return importlib.import_module(module)  # CI: a missing engine fails the test
    return pytest.importorskip(module)


def _markov(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Token ids with repeats (a sticky random walk), so n-grams and suffixes recur."""
    out = [rng.randrange(vocab)]
    while len(out) < n:
        r = rng.random()
        out.append(out[-1] if r < 0.1 else (out[-1] + 1) % vocab if r < 0.6 else rng.randrange(vocab))
    return out


def test_ngram_propose_equals_vllms_kernel():
    _need("vllm")
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

    rng = random.Random(0)
    cases = 0
    for _ in range(3000):
        seq = _markov(rng, rng.randrange(1, 60), rng.choice([3, 6, 20]))
        n_min = rng.randrange(1, 4)
        n_max = rng.randrange(n_min, 6)
        k = rng.randrange(1, 16)
        want = _find_longest_matched_ngram_and_propose_tokens(
            np.array(seq, dtype=np.int32), n_min, n_max, 10_000, k).tolist()
        got = ngram_propose(seq, k, n_max=n_max, n_min=n_min, rule="earliest")
        assert got == want, (seq, n_min, n_max, k)
        cases += bool(want)
    assert cases > 1500  # most cases drafted something: the comparison is not vacuous


class _Batch:
    """The fields of vLLM's InputBatch its suffix proposer reads, for one request."""

    def __init__(self, req_id: str, prompt: list[int]) -> None:
        self.req_ids = [req_id]
        self.req_id_to_index = {req_id: 0}
        self.num_prompt_tokens = np.array([len(prompt)])
        self.tokens = list(prompt)

    @property
    def num_tokens_no_spec(self) -> np.ndarray:
        return np.array([len(self.tokens)])

    @property
    def token_ids_cpu(self) -> np.ndarray:
        return np.array([self.tokens], dtype=np.int32)


def test_engine_suffix_drafts_what_vllms_proposer_drafts():
    _need("vllm")
    _need("arctic_inference")
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    s = SuffixSettings(max_tree_depth=12, max_cached_requests=3)  # small: eviction happens
    spec = SimpleNamespace(num_speculative_tokens=s.spec_tokens,
                           suffix_decoding_max_tree_depth=s.max_tree_depth,
                           suffix_decoding_max_spec_factor=s.max_spec_factor,
                           suffix_decoding_min_token_prob=s.min_token_prob,
                           suffix_decoding_max_cached_requests=s.max_cached_requests)
    theirs = SuffixDecodingProposer(SimpleNamespace(speculative_config=spec,
                                                    model_config=SimpleNamespace(max_model_len=4096)))
    ours = EngineSuffix(s)
    rng = random.Random(1)
    drafted = 0
    for r in range(8):
        truth = _markov(rng, 140, 12)  # the "target's" greedy text: prompt, then its output
        prompt, req = truth[:20], f"r{r}"
        batch = _Batch(req, prompt)
        ours.start(req, prompt)
        new = [truth[20]]  # the prefill's token
        while True:
            batch.tokens += new
            want = theirs.propose(s.spec_tokens, batch, [new])[0]
            got = ours.propose(req, new, batch.tokens)
            assert got == want, (r, len(batch.tokens))
            drafted += bool(want)
            if len(batch.tokens) >= len(truth) - 1:
                break
            pos = len(batch.tokens)
            a = 0
            while a < len(want) and pos + a < len(truth) - 1 and want[a] == truth[pos + a]:
                a += 1
            new = list(want[:a]) + [truth[pos + a]]
        ours.stop(req)
    assert drafted > 100


def test_engine_and_in_process_evaluations_take_equal_steps(tmp_path):
    """vLLM (dflash, ngram, suffix) and the in-process evaluator on the tiny target and the
    shipped drafter: the same tokens and the same verify steps, prompt by prompt."""
    _need("vllm")
    _need("arctic_inference")
    from omegaconf import OmegaConf

    from dflash_lit.eval.cli import evaluate, evaluate_in_engine

    cfg = OmegaConf.load(ROOT / "conf" / "tools" / "evaluate.yaml")
    cfg.pop("hydra")
    overrides = {"ckpt": str(DRAFTER), "prompts": "tiny_heldout", "limit": 6,
                 "max_new_tokens": 80, "dtype": "float32", "methods": ["chain", "ngram", "suffix"],
                 "progress": False, "plot": False, "warmup": False}
    cfg = OmegaConf.merge(cfg, overrides)
    assert evaluate(cfg, tmp_path / "inprocess") == 0
    assert evaluate_in_engine(cfg, tmp_path / "vllm") == 0
    a = json.loads((tmp_path / "inprocess" / "report.json").read_text())
    b = json.loads((tmp_path / "vllm" / "report.json").read_text())
    assert b["lossless"] and a["lossless"] and b["engine"]["name"] == "vllm"
    for m in ("chain", "ngram", "suffix"):
        steps_a = [row[m] for row in a["per_prompt"]]
        steps_b = [row[m] for row in b["per_prompt"]]
        assert steps_a == steps_b, m  # every step's committed tokens, prompt by prompt
        assert a["methods"][m]["steps"] == b["methods"][m]["steps"] > 0
    assert a["methods"]["chain"]["tau"] > 2  # a trained drafter: the equality is not trivial
