"""Regeneration and evaluation render a prompt to the same token ids for the same settings."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from test_regenerate import REPO, make_cfg, toy  # noqa: F401  (toy: the fixture)

from dflash_lit.data.regenerate import run
from dflash_lit.errors import UserError
from dflash_lit.eval.cli import make_renderer
from dflash_lit.eval.prompts import load_prompts

# A Qwen3-like template: a system turn and an optional empty think block.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
SETTINGS = ["chat=true", "system_prompt=Answer in Python.", "+chat_template_kwargs.enable_thinking=false"]


def _eval_cfg(overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf" / "tools"), version_base="1.3"):
        return compose("evaluate", overrides=["ckpt=unused", *overrides])


@pytest.fixture(scope="module")
def think_target(toy, tmp_path_factory):  # noqa: F811
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("think") / "target"
    tok = AutoTokenizer.from_pretrained(toy["plain"])
    tok.chat_template = THINK_TEMPLATE
    tok.save_pretrained(d)
    toy["model"].save_pretrained(d)
    return d


def test_regenerated_and_evaluated_prompts_have_identical_ids(think_target, tmp_path):
    from transformers import AutoTokenizer

    prompts = tmp_path / "p.jsonl"
    texts = {"a": "def add(a, b):", "b": "hello world", "c": "the quick brown fox"}
    prompts.write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in texts.items()))
    out = tmp_path / "shards"
    run(make_cfg(target__path=str(think_target), out=str(out), chat=True,
                 system_prompt="Answer in Python.", chat_template_kwargs={"enable_thinking": False},
                 sources=[{"path": str(prompts), "name": "p", "id_field": "id"}]))
    table = pq.read_table(out / "shard-00000.parquet").to_pylist()
    regenerated = {r["id"].removeprefix("p:"): r["input_ids"][: r["prompt_len"]] for r in table}

    tok = AutoTokenizer.from_pretrained(think_target)
    renderer = make_renderer(_eval_cfg(SETTINGS), tok, str(think_target))
    evaluated = {p.id: renderer.ids(p) for p in load_prompts("jsonl", prompts, "prompt")}
    assert evaluated == regenerated and sorted(evaluated) == ["a", "b", "c"]
    text = tok.decode(evaluated["a"])
    assert text.startswith("<|im_start|>system\nAnswer in Python.") and "<think>" in text
    # the settings matter: without them evaluation would see other prompts
    plain = make_renderer(_eval_cfg(["chat=true"]), tok, str(think_target))
    assert plain.ids(load_prompts("jsonl", prompts, "prompt")[0]) != evaluated["a"]
    assert renderer.settings() == {"chat": True, "chat_template_kwargs": {"enable_thinking": False},
                                   "system_prompt": "Answer in Python."}


def test_chat_true_needs_a_template(toy):  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy["plain"])
    assert make_renderer(_eval_cfg([]), tok, "T").chat is False  # auto: no template, raw text
    with pytest.raises(UserError, match=r"chat=true but the tokenizer at T has no chat template"):
        make_renderer(_eval_cfg(["chat=true"]), tok, "T")
