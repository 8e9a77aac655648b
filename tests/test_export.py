"""Checkpoint loading, z-lab export round-trip, evaluate.py / export.py end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from dflash_lit import DFlashConfig, DFlashDrafter
from dflash_lit.eval.cli import evaluate
from dflash_lit.eval.loading import load_drafter
from dflash_lit.export.cli import export
from dflash_lit.export.zlab import export_zlab
from dflash_lit.tiny.random_targets import save_tiny, tiny_qwen3

ROOT = Path(__file__).resolve().parents[1]
V, D, L = 96, 32, 4


def cfg(**kw) -> DFlashConfig:
    base = dict(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, num_hidden_layers=1, block_size=4, mask_token_id=3,
                num_target_layers=L, target_layer_ids=[0, 2], vocab_size=V)
    base.update(kw)
    return DFlashConfig(**base)


def make_ckpt(path: Path, drafters: dict[str, DFlashDrafter], target_path: str) -> Path:
    """A Lightning-style .ckpt following the training module's contract."""
    state = {f"drafters.{n}.{k}": v.clone() for n, d in drafters.items()
             for k, v in d.state_dict().items()}
    ckpt = {
        "epoch": 0, "global_step": 5, "state_dict": state,
        "dflash": {
            "version": 1,
            "drafters": {n: {"config": d.config.to_dict()} for n, d in drafters.items()},
            "target": {"path": target_path, "layer_ids": [0, 2], "hidden_size": D,
                       "num_layers": L, "vocab_size": V},
        },
    }
    torch.save(ckpt, path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    target_dir = save_tiny(tiny_qwen3(vocab_size=V, hidden_size=D, num_layers=L, head_dim=8,
                                      intermediate_size=64, seed=0), tmp / "target")
    torch.manual_seed(0)
    drafters = {"main": DFlashDrafter(cfg()), "gamma7": DFlashDrafter(cfg(num_hidden_layers=2))}
    ckpt = make_ckpt(tmp / "last.ckpt", drafters, str(target_dir))
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": t}) + "\n" for i, t in
                               enumerate(["def add(a, b):\n", "x = [1, 2, 3]\nfor i in x:\n",
                                          "class Foo:\n    def __init__(self):\n"])))
    return {"tmp": tmp, "target": target_dir, "ckpt": ckpt, "drafters": drafters,
            "prompts": prompts}


def test_load_drafter_by_name(setup):
    d, info = load_drafter(setup["ckpt"], "gamma7")
    assert info.source == "ckpt" and info.name == "gamma7"
    assert info.available == ["gamma7", "main"] and info.global_step == 5
    assert info.target["path"] == str(setup["target"])
    src = setup["drafters"]["gamma7"].state_dict()
    assert all(torch.equal(src[k], v) for k, v in d.state_dict().items())
    with pytest.raises(ValueError, match=r"holds 2 drafters \['gamma7', 'main'\]; choose one"):
        load_drafter(setup["ckpt"])
    with pytest.raises(ValueError, match=r"no drafter named 'v9'; available: \['gamma7', 'main'\]"):
        load_drafter(setup["ckpt"], "v9")
    bad = setup["tmp"] / "plain.ckpt"
    torch.save({"state_dict": {}}, bad)
    with pytest.raises(ValueError, match="no 'dflash' metadata"):
        load_drafter(bad)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_export_reload_identical(setup, dtype):
    out = setup["tmp"] / f"zlab_{dtype}"
    res = export_zlab(setup["ckpt"], out, name="main", dtype=dtype)
    assert res.weights_equal
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [0, 2]}
    assert cfg_json["block_size"] == 4 and cfg_json["architectures"] == ["DFlashDraftModel"]
    readme = (out / "README.md").read_text()
    assert '"method": "dflash"' in readme and '"num_speculative_tokens": 3' in readme
    assert f"--speculative-draft-model-path {out}" in readme and "[1, 3]" in readme
    if dtype is None:
        assert res.max_abs_diff == 0.0 and res.logits_max_abs_diff == 0.0
        d, info = load_drafter(out)
        assert info.source == "zlab"
        src = setup["drafters"]["main"]
        x, th, pos = torch.randn(1, 4, D), torch.randn(1, 5, 2 * D), torch.arange(9)[None]
        assert torch.equal(d(x, th, pos), src(x, th, pos))
    else:
        assert cfg_json["torch_dtype"] == "bfloat16" and res.dtype == "bfloat16"
        assert 0 < res.max_abs_diff < 0.1


def test_export_sliding_window_round_trips(setup):
    """drafter.sliding_window goes out the way vLLM / SGLang / z-lab read it and comes back."""
    src = DFlashDrafter(cfg(sliding_window=5, num_hidden_layers=2))
    ckpt = make_ckpt(setup["tmp"] / "swa.ckpt", {"swa": src}, str(setup["target"]))
    out = setup["tmp"] / "zlab_swa"
    res = export_zlab(ckpt, out)
    assert res.weights_equal and res.max_abs_diff == 0.0  # _compare's 7 context tokens > 5
    cj = json.loads((out / "config.json").read_text())
    assert (cj["sliding_window"], cj["use_sliding_window"], cj["is_causal"]) == (5, True, False)
    assert cj["layer_types"] == ["sliding_attention"] * 2 and cj["dflash_config"]["causal"] is False
    assert "Sliding window:** each block sees the 5 context tokens" in (out / "README.md").read_text()
    d, _ = load_drafter(out)
    assert d.config.sliding_window == 5 and d.config.to_zlab_dict() == src.config.to_zlab_dict()
    x, th, pos = torch.randn(1, 4, D), torch.randn(1, 9, 2 * D), torch.arange(13)[None]
    assert torch.equal(d(x, th, pos), src(x, th, pos))


def test_read_sliding_window_variants():
    """Windows as other producers write them; what this drafter cannot honour is an error."""
    from dflash_lit.model.config import read_sliding_window

    base = cfg().to_zlab_dict()
    assert "sliding_window" not in base and read_sliding_window(base) is None
    full = {**base, "layer_types": ["full_attention"], "sliding_window": 64}
    assert read_sliding_window(full) is None
    vllm = {**base, "dflash_config": {"use_swa": True, "swa_window_size": 32}}  # non-causal
    assert read_sliding_window(vllm) == 32
    swa = {**base, "layer_types": ["sliding_attention"], "sliding_window": 16}
    with pytest.raises(ValueError, match="causal within the block"):  # z-lab/vLLM default
        read_sliding_window(swa)
    assert read_sliding_window({**swa, "dflash_config": {"causal": False}}) == 16
    with pytest.raises(ValueError, match="mixed or unknown layer types"):
        read_sliding_window({**swa, "layer_types": ["sliding_attention", "full_attention"]})


def _eval_cfg(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf" / "tools"), version_base="1.3"):
        return compose("evaluate", overrides=overrides)


def test_evaluate_exported_dir_equals_checkpoint(setup):
    common = [f"prompts_path={setup['prompts']}", "prompts=jsonl", "max_new_tokens=16",
              "budgets=[3,8]", "progress=false", "warmup=false", "offline_streak=true"]
    out_ckpt = setup["tmp"] / "eval_ckpt"
    assert evaluate(_eval_cfg([f"ckpt={setup['ckpt']}", "drafter=main", f"out={out_ckpt}",
                               *common]), out_ckpt) == 0
    zdir = setup["tmp"] / "zlab_eval"
    export_zlab(setup["ckpt"], zdir, name="main")
    out_dir = setup["tmp"] / "eval_dir"
    assert evaluate(_eval_cfg([f"ckpt={zdir}", f"target={setup['target']}", f"out={out_dir}",
                               *common]), out_dir) == 0
    a = json.loads((out_ckpt / "report.json").read_text())
    b = json.loads((out_dir / "report.json").read_text())
    assert a["lossless"] and b["lossless"]
    assert a["rendering"] == {"chat": False, "chat_template_kwargs": {}, "system_prompt": None,
                              "tokenizer": str(setup["target"]),
                              "tokenizer_fingerprint": a["rendering"]["tokenizer_fingerprint"]}
    assert a["tau_chain"] == b["tau_chain"] and a["tau_tree"] == b["tau_tree"]
    assert a["tau_ngram"] == b["tau_ngram"] and a["offline"]["streak"] == b["offline"]["streak"]
    for ra, rb in zip(a["per_prompt"], b["per_prompt"]):
        assert ra["chain"] == rb["chain"] and ra["tree_b8"] == rb["tree_b8"]
    assert [r["id"] for r in a["per_prompt"]] == ["q0", "q1", "q2"]
    assert (out_ckpt / "summary.md").read_text().count("| tree_b") == 4
    assert (out_ckpt / "acceptance.png").stat().st_size > 1000


def test_evaluate_exits_nonzero_when_not_lossless(setup, monkeypatch):
    import dflash_lit.eval.report as report_mod

    real = report_mod.chain_generate

    def corrupt(*args, **kwargs):
        r = real(*args, **kwargs)
        r.tokens[3] = (r.tokens[3] + 1) % V
        return r

    monkeypatch.setattr(report_mod, "chain_generate", corrupt)
    out = setup["tmp"] / "eval_bad"
    code = evaluate(_eval_cfg([f"ckpt={setup['ckpt']}", "drafter=main", f"out={out}",
                             f"prompts_path={setup['prompts']}", "prompts=jsonl", "limit=1",
                             "max_new_tokens=8", "methods=[chain]", "progress=false",
                             "warmup=false", "plot=false"]), out)
    assert code == 1
    rep = json.loads((out / "report.json").read_text())
    assert rep["lossless"] is False
    assert rep["mismatches"][0]["prompt_id"] == "q0" and rep["mismatches"][0]["position"] == 3


def test_evaluate_mismatched_target_errors(setup):
    other = save_tiny(tiny_qwen3(vocab_size=V, hidden_size=48, num_layers=L, head_dim=8,
                                 intermediate_size=64), setup["tmp"] / "wide_target")
    with pytest.raises(ValueError, match="hidden_size=32 but target hidden size=48"):
        evaluate(_eval_cfg([f"ckpt={setup['ckpt']}", "drafter=main", f"target={other}",
                          "prompts=humaneval", "limit=1"]), setup["tmp"] / "eval_wide")


def test_evaluate_tokenizer_larger_than_target_vocab_errors(setup):
    """A tokenizer of another model (102 tokens) against a 96-row embedding: refused up front."""
    from dflash_lit.tiny.random_targets import tiny_char_tokenizer

    tok_dir = setup["tmp"] / "big_tokenizer"
    tiny_char_tokenizer(128).save_pretrained(tok_dir)
    with pytest.raises(ValueError, match=rf"tokenizer={tok_dir}: the tokenizer has 102 tokens but "
                                         rf"the target's embedding has vocab_size={V} rows"):
        evaluate(_eval_cfg([f"ckpt={setup['ckpt']}", "drafter=main",
                                          f"tokenizer={tok_dir}", "prompts=humaneval", "limit=1"]),
                               setup["tmp"] / "eval_bigtok")


def _export_cfg(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf" / "tools"), version_base="1.3"):
        return compose("export", overrides=overrides)


def test_export_one_drafter_of_a_multi_drafter_checkpoint(setup, capsys):
    out = setup["tmp"] / "cli_export"
    assert export(_export_cfg([f"ckpt={setup['ckpt']}", f"out={out}", "drafter=gamma7"])) == 0
    assert "weights equal=True, max abs diff outputs=0" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_real_train_checkpoint_evaluates_and_exports(tmp_path):
    """train.py -> last.ckpt -> evaluate.py (lossless, τ reported) -> export.py -> evaluate the
    exported directory: the same τ, all as subprocesses like a user runs them."""
    import os
    import subprocess

    from train_utils import base_overrides, make_shards

    target = save_tiny(tiny_qwen3(vocab_size=128, hidden_size=64, num_layers=8, seed=0),
                       tmp_path / "target")
    data = make_shards(tmp_path / "train", n=24)
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")

    def run(script: str, *args: str) -> subprocess.CompletedProcess:
        p = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        return p

    run("train.py", *base_overrides(tmp_path, data), f"target.path={target}", "target.build=null",
        "trainer.max_steps=6")
    ckpt = next((tmp_path / "outputs").glob("*/*/checkpoints/last.ckpt"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": t}) + "\n"
                               for i, t in enumerate(["def f(x):\n", "for i in range(3):\n"])))
    common = ["prompts=jsonl", f"prompts_path={prompts}", "max_new_tokens=24", "budgets=[4]",
              "progress=false", "warmup=false", "plot=false"]
    run("evaluate.py", f"ckpt={ckpt}", *common, f"out={tmp_path / 'ev_ckpt'}")
    run("export.py", f"ckpt={ckpt}", f"out={tmp_path / 'zlab'}")
    run("evaluate.py", f"ckpt={tmp_path / 'zlab'}", f"target={target}", *common,
        f"out={tmp_path / 'ev_dir'}")
    a = json.loads((tmp_path / "ev_ckpt" / "report.json").read_text())
    b = json.loads((tmp_path / "ev_dir" / "report.json").read_text())
    assert a["lossless"] is True and b["lossless"] is True
    assert 1.0 <= a["tau_chain"] <= 8.0 and a["tau_tree"]["4"] >= 1.0  # Bs = 8 in base_overrides
    assert a["tau_chain"] == b["tau_chain"] and a["tau_tree"] == b["tau_tree"]
    assert a["settings"]["max_new_tokens"] == 24 and a["num_prompts"] == 2 and a["block_size"] == 8


def test_trust_checkpoint_is_the_only_way_to_unpickle_objects(tmp_path):
    """A legacy file holding a harmless object (an OmegaConf config) is refused by the safe load
    with one line naming the object, and loads with ``trust=True`` (with a warning)."""
    import torch
    from omegaconf import OmegaConf

    from dflash_lit.checkpoint import safe_load
    from dflash_lit.errors import UserError

    f = tmp_path / "legacy.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "cfg": OmegaConf.create({"lr": 1e-3})}, f)
    with pytest.raises(UserError, match=r"refused: it holds a pickled omegaconf\.dictconfig\.DictConfig"):
        safe_load(f)
    with pytest.warns(UserWarning, match="trust_checkpoint=true"):
        ck = safe_load(f, trust=True)
    assert ck["cfg"].lr == 1e-3 and torch.equal(ck["state_dict"]["w"], torch.ones(2))
    plain = tmp_path / "plain.ckpt"  # what dflash-lit writes loads without any opt-in
    torch.save({"state_dict": {"w": torch.ones(2)}, "dflash": {"version": 1}}, plain)
    assert safe_load(plain)["dflash"] == {"version": 1}


def test_a_mask_token_that_is_a_stop_token_is_one_warning_line(tmp_path, caplog):
    """z-lab's reference loop stops at the first stop token after the prompt, and it pre-fills
    its buffer with the mask token: a drafter whose mask is the target's EOS reports tau 1.0
    there. Export (from the ids the training run recorded) and training config say so."""
    import logging

    from dflash_lit.compat import mask_stop_problem, stop_token_ids

    class C:
        eos_token_id = [3, 7]

    class G:
        eos_token_id = 5

    assert stop_token_ids(C(), G()) == [3, 5, 7] and stop_token_ids(C(), None) == [3, 7]
    assert mask_stop_problem(4, [3, 5], "target") is None
    msg = mask_stop_problem(3, [3, 5], "target")
    assert "mask_token_id=3 is a stop token of the target (eos ids [3, 5])" in msg
    assert "target.mask_token_id" in msg and "\n" not in msg
    torch.manual_seed(0)
    ckpt = make_ckpt(tmp_path / "m.ckpt", {"main": DFlashDrafter(cfg(mask_token_id=3))}, "t")
    ck = torch.load(ckpt, weights_only=True)
    ck["dflash"]["target"]["eos_token_ids"] = [3]  # what training records now
    torch.save(ck, ckpt)
    with caplog.at_level(logging.WARNING):
        export_zlab(ckpt, tmp_path / "out")
    assert any("mask_token_id=3 is a stop token" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        export_zlab(ckpt, tmp_path / "out2", stop_ids=[0])  # the target says otherwise
    assert not any("stop token" in r.getMessage() for r in caplog.records)


def test_serve_commands_for_a_target_built_into_the_cache_work_with_the_variable_unset(
        tmp_path, monkeypatch) -> None:
    """A target under $DFLASH_CACHE (built, not in git) is named as such in the card, and the
    serve command falls back to the default cache when the variable is unset."""
    import subprocess

    from dflash_lit.eval.loading import DrafterInfo
    from dflash_lit.export.zlab import serve_readme

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("DFLASH_CACHE", raising=False)
    built = tmp_path / ".cache" / "dflash-lit" / "smollm2"
    info = DrafterInfo(source="ckpt", path=str(tmp_path / "last.ckpt"),
                       target={"path": str(built), "num_layers": L, "vocab_size": V})
    text = serve_readme(DFlashDrafter(cfg()), ROOT / "artifacts" / "x", info)
    line = next(x for x in text.splitlines() if x.startswith("vllm serve "))
    assert line.startswith('vllm serve "${DFLASH_CACHE:-$HOME/.cache/dflash-lit}/smollm2" ')
    quoted = line.removeprefix("vllm serve ").split(" --")[0]
    out = subprocess.run(["bash", "-c", f"echo {quoted}"], capture_output=True, text=True,
                         env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == str(built)
