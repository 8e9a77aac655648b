"""Every entry point, run as a user runs it: a user error is one stderr line (what, where,
what to do) with exit status 2 and no traceback, raised before any weights load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_utils import REPO, base_overrides, make_shards

from dflash_lit.tiny.random_targets import save_tiny, tiny_qwen3


def run_entry(script: str, args: list[str], cwd: Path, timeout: float = 300):
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    env.pop("DFLASH_TRACEBACK", None)
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(p: subprocess.CompletedProcess, pattern: str) -> str:
    import re

    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "HYDRA_FULL_ERROR" not in p.stderr, p.stderr
    assert len(err) == 1, p.stderr
    assert re.search(pattern, err[0]), err[0]
    return err[0]


@pytest.fixture(scope="module")
def weightless_target(tmp_path_factory):
    """A target directory whose config and tokenizer are fine but whose weights are missing:
    an error about anything else proves the check ran before the weights load."""
    d = save_tiny(tiny_qwen3(vocab_size=128), tmp_path_factory.mktemp("t") / "target")
    for f in d.glob("*.safetensors"):
        f.unlink()
    return d


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("cli_data") / "train", n=16)


TRAIN_CASES = {
    "value of the wrong type": (["data.token_budget=abc"], r"^error: data.token_budget='abc': expected an integer$"),
    "out-of-range value": (["loss.gamma=-1"], r"^error: loss.gamma=-1: the position-decay constant must be > 0"),
    "datamodule check": (["data.token_budget=16"], r"^error: data.max_length=128 exceeds data.token_budget=16: .*raise token_budget"),
    "per-drafter key that is global": (["+drafters.main.optim.warmup_frac=0.1"],
                                       r"^error: drafters.main.optim.warmup_frac: one value for the whole run.*set optim.warmup_frac"),
    "unknown per-drafter key": (["+drafters.main.schedule.noise.sigma=0.1"],
                                r"^error: drafters.main.schedule.noise.sigma: unknown key; accepted: \['final', 'kind', 'peak', 'warmup_frac'\]"),
}


@pytest.mark.parametrize("case", sorted(TRAIN_CASES))
def test_train_user_errors_are_one_line_before_the_weights_load(tmp_path, data, weightless_target, case):
    ov, pattern = TRAIN_CASES[case]
    args = base_overrides(tmp_path, data) + [f"target.path={weightless_target}", "target.build=null",
                                             "target.mask_token_id=3", *ov]
    assert_one_line_error(run_entry("train.py", args, tmp_path), pattern)


def test_export_and_evaluate_refuse_a_file_that_is_not_a_checkpoint(tmp_path):
    bad = tmp_path / "notes.ckpt"
    bad.write_text("not a checkpoint\n")
    pattern = rf"^error: ckpt={bad}: not a readable checkpoint \(UnpicklingError: .*\); pass a training .ckpt"
    run = f"hydra.run.dir={tmp_path / 'run'}"
    assert_one_line_error(run_entry("export.py", [f"ckpt={bad}", f"out={tmp_path / 'o'}", run], tmp_path),
                          pattern)
    assert_one_line_error(run_entry("evaluate.py", [f"ckpt={bad}", "prompts=tiny_heldout", run], tmp_path),
                          pattern)


def test_evaluate_unknown_prompt_set_and_regenerate_missing_target(tmp_path):
    run = f"hydra.run.dir={tmp_path / 'run'}"
    assert_one_line_error(run_entry("evaluate.py", ["ckpt=x.ckpt", "prompts=mbpp", run], tmp_path),
                          r"^error: unknown prompt set 'mbpp': choose one of")
    assert_one_line_error(
        run_entry("regenerate.py", [f"target.path={tmp_path / 'none'}", run], tmp_path),
        rf"^error: target.path: {tmp_path / 'none'} does not exist; pass target.path=")


class _RunsCode:
    """Unpickling this runs ``touch <marker>`` (what a malicious checkpoint would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_by_every_entry_point(tmp_path, data,
                                                                           weightless_target):
    import torch

    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": _RunsCode(marker)}, evil)
    refused = (rf"={evil}: refused: it holds a pickled posix.system, which could run code when "
               r"loaded .* only if you trust its source, pass trust_checkpoint=true$")
    run = f"hydra.run.dir={tmp_path / 'run'}"
    assert_one_line_error(run_entry("export.py", [f"ckpt={evil}", f"out={tmp_path / 'o'}", run],
                                    tmp_path), r"^error: ckpt" + refused)
    assert_one_line_error(run_entry("evaluate.py", [f"ckpt={evil}", "prompts=tiny_heldout", run],
                                    tmp_path), r"^error: ckpt" + refused)
    args = base_overrides(tmp_path, data) + [f"target.path={weightless_target}", "target.build=null",
                                             "target.mask_token_id=3", f"ckpt_path={evil}"]
    assert_one_line_error(run_entry("train.py", args, tmp_path), r"^error: ckpt_path" + refused)
    assert not marker.exists()  # no entry point ran the file's code


def test_a_drafter_dir_with_a_malformed_config_is_one_line(tmp_path):
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text("[1, 2]")
    run = f"hydra.run.dir={tmp_path / 'run'}"
    assert_one_line_error(run_entry("export.py", [f"ckpt={d}", f"out={tmp_path / 'o'}", run], tmp_path),
                          rf"^error: {d / 'config.json'}: not a DFlash drafter config \(")


def test_evaluate_draft_vocab_needs_a_recorded_training_vocab(tmp_path):
    """draft_vocab=true on a drafter without recorded train_vocab ids (a z-lab directory) is one
    line naming the key and the fix, before the target loads."""
    from dflash_lit import DFlashConfig, DFlashDrafter

    cfg = DFlashConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=48, num_hidden_layers=1, block_size=4, mask_token_id=3,
                       num_target_layers=4, target_layer_ids=[0, 2], vocab_size=128)
    d = DFlashDrafter(cfg).save_pretrained(tmp_path / "drafter")
    run = f"hydra.run.dir={tmp_path / 'run'}"
    assert_one_line_error(
        run_entry("evaluate.py", [f"ckpt={d}", "draft_vocab=true", f"target={tmp_path / 'none'}",
                                  "prompts=tiny_heldout", run], tmp_path),
        rf"^error: draft_vocab=true: {d} records no training vocabulary .*set draft_vocab=false$")
