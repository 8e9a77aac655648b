"""Llama-architecture targets with tied embeddings (the SmolLM2 layout) work like Qwen3 ones:
speculative decoding is lossless, training runs, the drafter shares the tied embed / lm_head,
export + evaluate of the trained drafter round-trip. (Layer capture: tests/test_target.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from train_utils import REPO, base_overrides, drafter_state, make_shards, run_train

from dflash_lit import DFlashConfig, DFlashDrafter
from dflash_lit.eval.speculative import (
    DFlashProposer,
    chain_generate,
    first_mismatch,
    ngram_generate,
    target_greedy,
    tree_generate,
)
from dflash_lit.eval.target_runner import TargetRunner, is_rollbackable
from dflash_lit.export.zlab import export_zlab
from dflash_lit.tiny.random_targets import save_tiny, tiny_llama

V, D, L, BS = 96, 32, 4, 4


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=V, hidden_size=D, num_layers=L, head_dim=8, intermediate_size=64,
                      seed=0)


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(1)
    cfg = DFlashConfig(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=48, num_hidden_layers=2, block_size=BS, mask_token_id=3,
                       num_target_layers=L, target_layer_ids=[0, 2, 3], vocab_size=V)
    return DFlashDrafter(cfg).eval()


def test_tied_embeddings_are_what_the_drafter_uses(target, drafter):
    assert target.config.tie_word_embeddings and target.config.model_type == "llama"
    runner = TargetRunner(target, [0, 2, 3])
    assert runner.lm_head.weight is runner.embed_tokens.weight  # one tensor, two roles
    prop = DFlashProposer(drafter, runner.embed_tokens, runner.lm_head)
    assert prop.lm_head.weight is target.model.embed_tokens.weight
    out = runner.forward([5, 6, 7], torch.arange(3), cache=None)
    assert is_rollbackable(out.cache)  # plain KV cache: chain rollback and trees work


@pytest.mark.parametrize("method", ["chain", "tree4", "tree8", "ngram"])
def test_lossless_on_llama(target, drafter, method):
    g = torch.Generator().manual_seed(7)
    for n in (5, 11, 17):
        p = torch.randint(4, V, (n,), generator=g).tolist()
        for max_new in (1, 2, 23):
            ref = target_greedy(target, p, max_new).tokens
            if method == "chain":
                r = chain_generate(target, drafter, p, max_new)
            elif method == "ngram":
                r = ngram_generate(target, p, max_new, block_size=BS)
            else:
                r = tree_generate(target, drafter, p, max_new, budget=int(method[4:]))
            assert r.tokens == ref, (method, p, first_mismatch(r.tokens, ref))
            assert sum(r.acceptance_lengths) + 1 == len(r.tokens) == max_new
            assert not r.recomputed



def test_train_two_steps_then_export_and_evaluate(tmp_path):
    """target=random_llama: 2 training steps; the drafter changes, the tied target does not
    enter the checkpoint; the export reloads equal through the target's tied lm_head, and
    evaluate.py decodes losslessly against the same Llama saved as an HF directory."""
    data = make_shards(tmp_path / "train", n=12)
    ov = [o for o in base_overrides(tmp_path, data) if not o.startswith("target=")]
    ov += ["target=random_llama", "trainer.max_steps=2", "val_max_anchors=4"]
    _, cfg = run_train(ov, tmp_path / "run")
    assert cfg.target.build.kind == "tiny_llama"
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    meta = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert meta["global_step"] == 2
    assert meta["dflash"]["target"]["model_type"] == "llama"
    assert not [k for k in meta["state_dict"] if "embed_tokens" in k or "lm_head" in k
                or k.startswith(("target.", "_target."))]
    state = drafter_state(ckpt)
    assert state and not [k for k in state if "embed_tokens" in k or "lm_head" in k]

    model = tiny_llama()  # the same weights as the run's target (seed 0)
    target_dir = save_tiny(model, tmp_path / "llama")
    res = export_zlab(ckpt, tmp_path / "zlab", lm_head=model.get_output_embeddings())
    assert res.weights_equal and res.max_abs_diff == 0.0 and res.logits_max_abs_diff == 0.0
    exported = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert exported["num_target_layers"] == 8 and exported["vocab_size"] == 128
    assert exported["hidden_size"] == 64
    ids = meta["dflash"]["drafters"]["main"]["config"]["target_layer_ids"]
    assert exported["dflash_config"]["target_layer_ids"] == ids
    assert exported["dflash_target"] == {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_layers": 8,
        "hidden_size": 64, "vocab_size": 128, "tie_word_embeddings": True}
    readme = (tmp_path / "zlab" / "README.md").read_text()
    assert "LlamaForCausalLM, tied embeddings" in readme

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "def add(a, b):\n"}) + "\n")
    from dflash_lit.eval.cli import evaluate
    with initialize_config_dir(config_dir=str(REPO / "conf" / "tools"), version_base="1.3"):
        ecfg = compose("evaluate", overrides=[
            f"ckpt={ckpt}", f"target={target_dir}", "prompts=jsonl", f"prompts_path={prompts}",
            "max_new_tokens=12", "budgets=[4]", "progress=false", "warmup=false", "plot=false",
            "dtype=float32", "device=cpu", f"out={tmp_path / 'eval'}"])
    assert evaluate(ecfg, tmp_path / "eval") == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["lossless"] and report["target"]["num_layers"] == 8


def test_context_layer_ids_from_the_target_config():
    """A target config may state its K context layers; the formula covers other K."""
    from omegaconf import OmegaConf

    from dflash_lit.train.build import context_layer_ids

    t = OmegaConf.create({"context_layer_ids": [1, 8, 14, 21, 27]})
    assert context_layer_ids(t, 30, 5) == [1, 8, 14, 21, 27]
    assert context_layer_ids(t, 30, 3) == [1, 14, 27]  # formula
    assert context_layer_ids(OmegaConf.create({}), 30, 5) == [1, 8, 14, 21, 27]


def test_random_llama_config_composes():
    with initialize_config_dir(config_dir=str(Path(REPO) / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["target=random_llama"])
    assert cfg.target.build.kind == "tiny_llama" and cfg.target.build.tie_word_embeddings
