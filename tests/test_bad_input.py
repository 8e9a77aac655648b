"""Bad input, class by class: each fails before training with what is wrong, where (config
key or file:line) and what to do. The README's bad-input table lists these tests."""

from __future__ import annotations

import re

import pytest
from train_utils import base_overrides, make_shards, run_train

from dflash_lit.data.shards import write_shards


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_data")
    return make_shards(root / "train", n=24), make_shards(root / "val", n=4, seed=1)


CONFIG_CASES = {
    "negative gamma": (["loss.gamma=-1"], r"loss.gamma=-1: the position-decay constant must be > 0"),
    "block size 1": (["drafter.block_size=1"], r"drafters.main: block_size=1: .*use block_size >= 2"),
    "zero anchors": (["schedule.anchors.max=0"], r"drafters.main.anchors.max=0: must be >= 1"),
    "budget below one sequence": (["data.token_budget=16"],
                                  r"data.max_length=128 exceeds data.token_budget=16: .*raise token_budget"),
    "context layer out of range": (["drafter.target_layer_ids=[1,9]"],
                                   r"drafters.main: target_layer_ids=\[1, 9\]: \[9\] out of range for a target with 8"),
    "no mask token": (["target.mask_token_id=null"], r"target: no mask token; set target.mask_token_id"),
    "non-positive lr": (["optim.lr=-1"], r"optim.lr=-1: must be > 0"),
    "per-drafter lr": (["+drafters.main.optim.lr=0"], r"drafters.main.optim.lr=0.0: must be > 0"),
    "per-drafter global optim key": (["+drafters.main.optim.betas=[0.9,0.99]"],
                                     r"drafters.main.optim.betas: one value for the whole run.*set optim.betas"),
    "unknown per-drafter loss key": (["+drafters.main.loss.gama=4"],
                                     r"drafters.main.loss.gama: unknown key; accepted: \['gamma', 'labels', 'name'\]"),
    "unknown per-drafter section": (["+drafters.main.optimizer={lr: 1}"],
                                    r"drafters.main.optimizer: unknown key; per-drafter overrides go under"),
    "unknown drafter key": (["+drafters.main.drafter.num_layers=2"], r"drafters.main.drafter.num_layers: unknown key"),
    "negative noise": (["schedule.noise.peak=-0.1"], r"drafters.main.noise: peak/final must be >= 0"),
    "max_length 0": (["data.max_length=0"], r"max_length must be >= 1, got 0"),
    "anchor_scale out of range": (["anchor_scale=2"], r"anchor_scale=2.0: must be in \(0, 1\]"),
    "sliding window below block size": (["drafter.sliding_window=4"],
                                        r"drafters.main: sliding_window=4: must be an integer >= block_size=8"),
    "unknown optimizer": (["optim.name=sgd"], r"optim.name='sgd': use one of \['adamw', 'muon'\]"),
    "muon key without muon": (["+optim.muon_ns_steps=3"], r"optim.muon_ns_steps: read only with optim=muon"),
    "muon momentum 1": (["optim=muon", "optim.muon_momentum=1.0"], r"optim.muon_momentum=1.0: must be in \[0, 1\)"),
    "muon under fsdp": (["optim=muon", "trainer=fsdp"], r"optim=muon: not with an FSDP trainer.strategy"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_values_out_of_range(tmp_path, data, case):
    ov, msg = CONFIG_CASES[case]
    with pytest.raises(Exception) as ei:
        run_train(base_overrides(tmp_path, *data) + ["trainer.max_steps=1", *ov], tmp_path / "r")
    err = ei.value.__cause__ or ei.value
    assert isinstance(err, ValueError), repr(err)
    assert re.search(msg, str(err)), str(err)
    assert not (tmp_path / "r" / "checkpoints").exists()  # failed before any training


def test_loss_mask_of_wrong_length_names_file_and_row(tmp_path, data):
    bad = tmp_path / "badlen"
    write_shards([{"id": "a", "source": "s", "input_ids": [5] * 40, "loss_mask": [1] * 39}], bad)
    with pytest.raises(ValueError, match=r"shard-00000.parquet: row id 'a' \(row 0\): loss_mask has "
                                         r"39 entries but input_ids has 40.*regenerate the shard"):
        run_train(base_overrides(tmp_path, bad, data[1]) + ["trainer.max_steps=1"], tmp_path / "r")


def test_all_rows_filtered_out_is_an_error_with_the_counts(tmp_path, data):
    bad = tmp_path / "zeros"
    write_shards([{"id": f"z{i}", "source": "s", "input_ids": [5] * 40, "loss_mask": [0] * 40}
                  for i in range(3)], bad)
    with pytest.raises(ValueError, match=r"no rows left after filtering \(kept 0/3 rows; dropped: all-zero loss_mask 3.*check min_completion_tokens"):
        run_train(base_overrides(tmp_path, bad, data[1]) + ["trainer.max_steps=1"], tmp_path / "r")


def test_prompt_file_not_utf8_names_file_and_offset(tmp_path):
    from dflash_lit.data.prompts import PromptError, load_source, parse_sources

    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "ok"}\n{"prompt": "bad \xff"}\n')
    (src,) = parse_sources([{"path": str(f), "field": "prompt"}])
    prompts, stats = load_source(src)
    assert len(prompts) == 1 and stats.malformed == 1  # lenient mode: counted, reported
    with pytest.raises(PromptError, match=rf"{f}:2: not valid UTF-8 at byte offset 33 of the file \(byte 0xff\); re-encode"):
        load_source(src, strict=True)


def test_shards_of_another_tokenizer_are_refused_before_the_target_loads(tmp_path, data):
    """Shards regenerate.py made with one tokenizer, trained against a target whose tokenizer
    differs: their ids mean other tokens, so training refuses them, naming file and fix."""
    import json

    import pyarrow.parquet as pq

    from dflash_lit.data.vocab import META_KEY, tokenizer_fingerprint
    from dflash_lit.tiny.random_targets import save_tiny, tiny_char_tokenizer, tiny_qwen3

    target = save_tiny(tiny_qwen3(vocab_size=128), tmp_path / "target")
    shards = make_shards(tmp_path / "other", n=24)
    first = shards / "shard-00000.parquet"
    table = pq.read_table(first)
    other = tokenizer_fingerprint(tiny_char_tokenizer(64))  # as regenerate.py records it
    meta = {META_KEY: json.dumps({"tokenizer": other}).encode()}
    pq.write_table(table.replace_schema_metadata(meta), first)
    ov = base_overrides(tmp_path, shards, data[1]) + [f"target.path={target}", "trainer.max_steps=1"]
    have = tokenizer_fingerprint(tiny_char_tokenizer(128))
    with pytest.raises(ValueError, match=rf"data.path: {first} was regenerated with another "
                                         rf"tokenizer \(fingerprint {other}\) than the target's at "
                                         rf"target.path={target} \({have}\).*regenerate the data"):
        run_train(ov, tmp_path / "r")
    assert not (tmp_path / "r" / "checkpoints").exists()
    # the same shards recorded with the target's own tokenizer train
    meta = {META_KEY: json.dumps({"tokenizer": have}).encode()}
    pq.write_table(table.replace_schema_metadata(meta), first)
    run_train(ov + ["trainer.limit_val_batches=0"], tmp_path / "ok")
    assert (tmp_path / "ok" / "checkpoints" / "last.ckpt").is_file()
