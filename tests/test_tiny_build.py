"""Tiny embedded target: toy build (deterministic, loadable), prompts, resume, shipped artifacts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_lit.hashing import sha256_file
from dflash_lit.tiny.build import build
from dflash_lit.tiny.corpus import SourceFile, split_files, stable_fraction
from dflash_lit.tiny.model import get_preset, make_model
from dflash_lit.tiny.pretrain import StepIndexedChunks, chunk, cosine_with_warmup, pretrain
from dflash_lit.tiny.prompts import build_prompts, extract_prompts, module_name, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "artifacts" / "tiny"


def _quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> tuple[Path, Path]:
    """Two independent toy builds with the same seed."""
    a, b = tmp_path_factory.mktemp("toy_a"), tmp_path_factory.mktemp("toy_b")
    for d in (a, b):
        build(d, get_preset("toy"), seed=0, log=_quiet)
    return a, b


def test_toy_build_is_deterministic(toy):
    a, b = toy
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert sha256_file(a / "target" / name) == sha256_file(b / "target" / name), name
    for name in ("train.jsonl", "eval.jsonl"):
        assert (a / "prompts" / name).read_bytes() == (b / "prompts" / name).read_bytes()


def test_toy_target_loads(toy):
    d = toy[0] / "target"
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert len(tok) == 512 and model.config.vocab_size == 512
    assert (tok.eos_token, tok.pad_token, tok.mask_token) == ("<|endoftext|>",) * 2 + ("<|mask|>",)
    assert (tok.eos_token_id, tok.mask_token_id) == (0, 1)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [2, 3]
    assert model.config.model_type == "qwen3" and model.config.num_hidden_layers == 2
    assert model.config.eos_token_id == model.config.pad_token_id == 0
    text = "def add(a, b):\n    return a + b\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE round-trips; no BOS is prepended
    out = model(input_ids=torch.tensor([ids]))
    assert out.logits.shape == (1, len(ids), 512)
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 0 and gen["pad_token_id"] == 0


def test_build_info_records_files(toy):
    d = toy[0] / "target"
    info = json.loads((d / "build_info.json").read_text())
    assert info["complete"] is True and info["steps"] == 6 and info["seed"] == 0
    assert info["tokens_seen"] == 6 * 4 * 64
    assert math.isfinite(info["heldout_loss"]) and info["heldout_loss"] < math.log(512) + 0.5
    for name, rec in info["files"].items():
        assert sha256_file(d / name) == rec["sha256"], name
    assert set(info["files"]) >= {"config.json", "model.safetensors", "tokenizer.json",
                                  "tokenizer_config.json", "generation_config.json"}


def test_prompt_files_disjoint(toy):
    tr = read_jsonl(toy[0] / "prompts" / "train.jsonl")
    ev = read_jsonl(toy[0] / "prompts" / "eval.jsonl")
    assert len(tr) == 40 and len(ev) == 8
    assert not {r["id"] for r in tr} & {r["id"] for r in ev}
    assert not {r["prompt"] for r in tr} & {r["prompt"] for r in ev}
    for r in tr + ev:
        assert set(r) == {"id", "source", "prompt"} and r["source"] == "stdlib"
        assert r["prompt"].startswith(("def ", "async def ")) and r["prompt"].endswith("\n")


SRC = '''class A:
    def m(self, x):
        """Return x doubled, always."""
        return 2 * x

    def nodoc(self):
        return 1


def f(a, *, b=2):
    # comment kept
    """Add a and b together."""
    def inner():
        """Nested helper docstring."""
        return 0
    return a + b


def only_doc():
    """Has nothing but a docstring here."""
'''


def test_extract_prompts_exact_text():
    recs = extract_prompts(SourceFile("pkg/mod.py", SRC))
    assert [r["id"] for r in recs] == ["pkg.mod:A.m", "pkg.mod:f", "pkg.mod:f.<locals>.inner"]
    assert recs[0]["prompt"] == 'def m(self, x):\n    """Return x doubled, always."""\n'
    assert recs[1]["prompt"] == 'def f(a, *, b=2):\n    # comment kept\n    """Add a and b together."""\n'
    assert recs[2]["prompt"] == 'def inner():\n    """Nested helper docstring."""\n'


def test_build_prompts_split_by_id_hash():
    def variant(i: int) -> str:
        return SRC.replace("Return x", f"Return{i} x").replace("Add a", f"Add{i} a").replace(
            "Nested", f"Nested{i}")

    files = [SourceFile(f"m{i}.py", variant(i)) for i in range(30)]
    files.append(SourceFile("copy.py", variant(0)))  # same texts under other ids: deduplicated
    tr, ev = build_prompts(files, eval_frac=0.25, max_train=1000, max_eval=1000)
    assert len(tr) + len(ev) == 90
    assert [r["id"] for r in tr] == sorted(r["id"] for r in tr)
    capped_tr, _ = build_prompts(files, eval_frac=0.25, max_train=5, max_eval=1000)
    assert len(capped_tr) == 5 and {r["id"] for r in capped_tr} <= {r["id"] for r in tr}
    assert all(stable_fraction("prompt-split:" + r["id"]) < 0.25 for r in ev)
    assert all(stable_fraction("prompt-split:" + r["id"]) >= 0.25 for r in tr)
    assert module_name("json/__init__.py") == "json" and module_name("a/b.py") == "a.b"


def test_corpus_split_and_schedule():
    rels = [f"d{i}/f.py" for i in range(200)]
    tr, held = split_files(rels, 0.1)
    assert sorted(tr + held) == sorted(rels) and not set(tr) & set(held)
    assert split_files(list(reversed(rels)), 0.1)[1] == list(reversed(held))  # order-independent
    assert stable_fraction("x") == int.from_bytes(
        bytes.fromhex("2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881")[:8],
        "big") / 2**64
    assert cosine_with_warmup(0, 10, 110, 0.1) == pytest.approx(0.1)
    assert cosine_with_warmup(9, 10, 110, 0.1) == pytest.approx(1.0)
    assert cosine_with_warmup(60, 10, 110, 0.1) == pytest.approx(0.55)
    assert cosine_with_warmup(110, 10, 110, 0.1) == pytest.approx(0.1)


def test_step_indexed_chunks_cover_each_epoch():
    chunks = torch.arange(7 * 3).view(7, 3)
    ds = StepIndexedChunks(chunks, length=14, seed=5)
    firsts = [int(ds[j][0]) // 3 for j in range(14)]
    assert sorted(firsts[:7]) == list(range(7)) and sorted(firsts[7:]) == list(range(7))
    assert firsts[:7] != firsts[7:]  # a fresh permutation per epoch


class _Crash(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 4:
            raise RuntimeError("simulated crash")


def test_resume_matches_straight_run(toy, tmp_path):
    p = get_preset("toy")
    packed = torch.load(toy[0] / "_work" / "packed.pt")
    tr, va = chunk(packed["train"], p.seq_len), chunk(packed["heldout"], p.seq_len)[:4]

    def run(work: Path, callbacks=()) -> torch.nn.Module:
        m = make_model(p, 0)
        pretrain(m, p, 0, tr, va, work, lambda *_: None, log=_quiet, callbacks=callbacks)
        return m

    straight = run(tmp_path / "s")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path / "r", [_Crash()])
    assert (tmp_path / "r" / "ckpt" / "last.ckpt").exists()
    resumed = run(tmp_path / "r")
    for (n, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.skipif(not (SHIPPED / "target" / "build_info.json").exists(),
                    reason="artifacts/tiny/target not built yet")
def test_shipped_target_matches_build_info():
    d = SHIPPED / "target"
    info = json.loads((d / "build_info.json").read_text())
    for name, rec in info["files"].items():
        assert sha256_file(d / name) == rec["sha256"], f"{name} differs from build_info.json"
    total = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file()
                and "_work" not in f.parts)
    assert total <= 30 * 2**20, f"shipped artifacts are {total / 2**20:.1f} MiB > 30 MiB"
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d)
    assert model.config.num_hidden_layers >= 8 and tok.mask_token_id is not None
    assert len(tok) == model.config.vocab_size
    ev = read_jsonl(SHIPPED / "prompts" / "eval.jsonl")
    tr = read_jsonl(SHIPPED / "prompts" / "train.jsonl")
    assert not {r["id"] for r in tr} & {r["id"] for r in ev}
