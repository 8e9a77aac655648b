"""Regeneration: prompts → target (hf / openai backends) → resumable Parquet shards.

A toy byte-level BPE tokenizer and a tiny random Qwen3 are built in a temp dir; the openai
backend talks to a real HTTP server on 127.0.0.1 started here (misbehaving on demand).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

from dflash_lit.atomic import temporary_name
from dflash_lit.data.backends.hf import cut_at_stop
from dflash_lit.data.backends.openai import ServerError
from dflash_lit.data.prompts import (
    Prompt,
    PromptError,
    PromptSource,
    allocate,
    load_source,
    mix,
    parse_sources,
)
from dflash_lit.data.regenerate import run
from dflash_lit.errors import UserError

REPO = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = ["def add(a, b):", "hello world", "x", "the quick brown fox jumps over", "print",
           "return x + 1"]


# -- toy target -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Two target dirs with the same tiny Qwen3: `plain` (no chat template) and `chat`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("toy")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(["def add(a, b): return a + b", "hello world, the quick brown fox"] * 20,
                            trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    plain, chat = root / "plain", root / "chat"
    tok.save_pretrained(plain)
    model.save_pretrained(plain)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(chat)
    model.save_pretrained(chat)
    return {"plain": plain, "chat": chat, "tok": tok, "model": model}


def make_cfg(**kv):
    """The real conf/regenerate.yaml with dotted-key overrides (``openai__model`` → openai.model)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("regenerate")
    base = {"progress": False, "generation.max_new_tokens": 8, "openai.backoff_s": 0.01}
    for key, value in {**base, **{k.replace("__", "."): v for k, v in kv.items()}}.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def read_rows(out: Path) -> list[dict]:
    rows = []
    for shard in sorted(out.glob("shard-*.parquet")):
        rows.extend(pq.read_table(shard).to_pylist())
    return rows


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# -- fake OpenAI-compatible server -----------------------------------------------------------


def fake_text(prompt) -> str:
    """Deterministic answer for a prompt (token id list or text)."""
    ids = prompt if isinstance(prompt, list) else [ord(c) for c in prompt]
    return " " + " ".join(f"w{t % 7}" for t in ids[:3])


def fake_finish(prompt) -> str:
    return "length" if len(prompt) % 2 else "stop"


class FakeServer:
    """/v1/models, /v1/completions, /v1/chat/completions on 127.0.0.1; POSTs are numbered 1, 2, ...

    fail_first: the first N POSTs answer 500; slow: POST numbers answered after slow_s;
    malformed: POST numbers answered with broken JSON; truncated: POST numbers whose body stops
    halfway (Content-Length promises more, then the connection closes); empty: POST numbers
    answered with well-formed JSON holding no choice; dead_after: later POSTs answer 503;
    gate_after: later POSTs wait for ``gate`` (set by the test).
    """

    def __init__(self, fail_first=0, slow=(), malformed=(), truncated=(), empty=(), slow_s=1.5,
                 dead_after=None, gate_after=None):
        self.n, self.lock, self.bodies = 0, threading.Lock(), []
        self.gate = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _send(self, code, payload: bytes, cut: bool = False):
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload[: len(payload) // 2] if cut else payload)
                except OSError:  # the client timed out and went away
                    pass
                if cut:
                    self.close_connection = True

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": "toy"}]}).encode())
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.n += 1
                    k = server.n
                    server.bodies.append(body)
                if k <= fail_first or (dead_after is not None and k > dead_after):
                    return self._send(500 if k <= fail_first else 503, b'{"error": "boom"}')
                if k in malformed:
                    return self._send(200, b'{"choices": [ {"text": ')
                if k in empty:
                    return self._send(200, b'{"choices": [], "usage": {}}')
                if k in slow:
                    time.sleep(slow_s)
                if gate_after is not None and k > gate_after:
                    server.gate.wait(30)
                if self.path == "/v1/completions":
                    prompt = body["prompt"]
                    choice = {"text": fake_text(prompt), "finish_reason": fake_finish(prompt)}
                elif self.path == "/v1/chat/completions":
                    last = body["messages"][-1]["content"]
                    choice = {"message": {"role": "assistant", "content": fake_text(last)},
                              "finish_reason": "stop"}
                else:
                    return self._send(404, b'{"error": "not found"}')
                self._send(200, json.dumps({"choices": [choice]}).encode(), cut=k in truncated)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server_factory():
    servers = []

    def make(**kw):
        servers.append(FakeServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def expected_openai_gen(tok, prompt_ids) -> tuple[list[int], str]:
    """What the openai backend must store for the fake server's answer to these prompt ids."""
    ids = tok(fake_text(prompt_ids), add_special_tokens=False)["input_ids"]
    finish = fake_finish(prompt_ids)
    return ids + ([tok.eos_token_id] if finish == "stop" else []), finish


# -- prompt loading and mixing ---------------------------------------------------------------


def test_prompt_errors_name_file_and_line(tmp_path):
    src = lambda p, **kw: PromptSource(path=str(p), name="s", **kw)  # noqa: E731
    with pytest.raises(PromptError, match="file not found"):
        load_source(src(tmp_path / "nope.jsonl"))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": broken\n')
    with pytest.raises(PromptError, match=f"{bad}:2: malformed JSON"):
        load_source(src(bad), strict=True)
    prompts, st = load_source(src(bad))
    assert [p.id for p in prompts] == ["s:1"] and st.malformed == 1 and st.issues == {"bad_json": 1}

    raw = b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n'
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(raw)
    offset = raw.index(b"\xe9")
    with pytest.raises(PromptError, match=f"{latin}:2: not valid UTF-8 at byte offset {offset} "):
        load_source(src(latin), strict=True)

    missing = write_jsonl(tmp_path / "missing.jsonl", [{"prompt": "a"}, {"question": "b"}])
    with pytest.raises(PromptError, match=f"{missing}:2: missing field 'prompt'"):
        load_source(src(missing), strict=True)
    with pytest.raises(PromptError, match="field 'answer' is missing in every record"):
        load_source(src(missing, field="answer"))

    empty = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": " "}, {"prompt": "x"}, {"prompt": 3}])
    prompts, st = load_source(src(empty))
    assert [p.id for p in prompts] == ["s:2"] and st.empty == 1 and st.issues == {"bad_type": 1}

    with pytest.raises(PromptError, match="duplicate source name"):
        parse_sources([{"path": "a.jsonl"}, {"path": "b/a.jsonl"}])


def test_chat_messages_drop_last_assistant_and_parquet(tmp_path):
    import pyarrow as pa

    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ORIGINAL ANSWER"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": conv}, {"messages": conv[:1]}])
    prompts, st = load_source(PromptSource(path=str(path), field="messages", name="c"))
    assert [p.messages for p in prompts] == [conv[:2]]
    assert st.dropped_assistant == 1 and st.empty == 1  # system-only conversation: empty

    pq.write_table(pa.table({"q": ["a", None, "c"]}), tmp_path / "p.parquet")
    (src,) = parse_sources([{"path": str(tmp_path / "p.parquet"), "field": "q"}])
    assert src.format == "parquet" and src.name == "p"
    prompts, st = load_source(src)
    assert [p.id for p in prompts] == ["p:0", "p:2"] and st.issues == {"missing_field": 1}
    with pytest.raises(PromptError, match=r"column 'prompt' not in .*p.parquet; columns: \['q'\]"):
        load_source(PromptSource(path=str(tmp_path / "p.parquet"), format="parquet", name="p"))

    import datasets

    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"prompt": ["u", "v", "w"], "uid": ["a", "b", "a"]}),
        "test": datasets.Dataset.from_dict({"prompt": ["z"], "uid": ["c"]}),
    })
    dd.save_to_disk(str(tmp_path / "hf"))
    (src,) = parse_sources([{"path": str(tmp_path / "hf"), "id_field": "uid", "split": "train"}])
    assert src.format == "hf_dataset"
    prompts, st = load_source(src)
    assert [(p.id, p.text) for p in prompts] == [("hf:a", "u"), ("hf:b", "v")]
    assert st.issues == {"duplicate_id": 1}
    with pytest.raises(PromptError, match=r"has splits \['train', 'test'\]; set sources\[\].split"):
        load_source(PromptSource(path=str(tmp_path / "hf"), format="hf_dataset", name="hf"))


def test_mix_by_weight_is_deterministic_and_redistributes():
    assert allocate(8, [3, 1]) == [6, 2]
    assert allocate(5, [1, 1, 1]) == [2, 2, 1]
    srcs = [PromptSource(path="a", name="a", weight=3), PromptSource(path="b", name="b", weight=1)]
    pools = [[Prompt(f"a:{i}", "a", "") for i in range(20)],
             [Prompt(f"b:{i}", "b", "") for i in range(20)]]
    got, st = mix(pools, srcs, 8, seed=1)
    again, _ = mix(pools, srcs, 8, seed=1)
    assert [p.id for p in got] == [p.id for p in again] and st.selected == {"a": 6, "b": 2}
    assert len({p.id for p in got}) == 8
    # b has 1 prompt: its shortfall goes to a.
    pools[1] = pools[1][:1]
    got, st = mix(pools, srcs, 10, seed=1)
    assert st.selected == {"a": 9, "b": 1}
    # More requested than there is: everything accepted is taken, rejected prompts counted.
    got, st = mix(pools, srcs, 25, seed=1, accept=lambda p: p.id != "a:3")
    assert st.selected == {"a": 19, "b": 1} and st.rejected == {"a": 1, "b": 0}
    assert "a:3" not in {p.id for p in got} and len(got) == 20
    assert [p.id for p in mix(pools, srcs, None, seed=1)[0]] != [p.id for p in got]  # a:3 back


def test_cut_at_stop(toy):
    tok = toy["tok"]
    assert cut_at_stop([5, 6, 2, 7], [2], [], tok) == ([5, 6, 2], "stop")
    assert cut_at_stop([5, 6, 7], [2], [], tok) == ([5, 6, 7], "length")
    ids = tok("ab cd ef", add_special_tokens=False)["input_ids"]
    kept, reason = cut_at_stop(ids, [2], [" cd"], tok)
    assert reason == "stop" and tok.decode(kept).endswith("cd") and "ef" not in tok.decode(kept)


# -- hf backend ------------------------------------------------------------------------------


def test_hf_backend_matches_unpadded_greedy(toy, tmp_path):
    tok, model = toy["tok"], toy["model"]
    lines = [json.dumps({"prompt": PROMPTS[0]}), json.dumps({"prompt": PROMPTS[1]}), "{bad json",
             json.dumps({"prompt": PROMPTS[2]}), json.dumps({"text": "no field"}),
             json.dumps({"prompt": "   "})]
    data = ("\n".join(lines) + "\n").encode() + b'{"prompt": "caf\xe9"}\n'
    data += "".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[3:]).encode()
    data += json.dumps({"prompt": "hello " * 40}).encode() + b"\n\n"
    path = tmp_path / "toy.jsonl"
    path.write_bytes(data)
    ids = {"toy:1": PROMPTS[0], "toy:2": PROMPTS[1], "toy:4": PROMPTS[2], "toy:8": PROMPTS[3],
           "toy:9": PROMPTS[4], "toy:10": PROMPTS[5]}
    out = tmp_path / "out"
    summary = run(make_cfg(target__path=str(toy["plain"]), sources=[{"path": str(path)}], out=str(out),
                           hf__batch_size=4, max_prompt_tokens=30))

    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == sorted(ids)
    eos = tok.eos_token_id
    for r in rows:
        prompt_ids = tok(ids[r["id"]])["input_ids"]
        p, g = r["prompt_len"], r["gen_len"]
        assert p == len(prompt_ids) and r["input_ids"][:p] == prompt_ids
        assert r["loss_mask"] == [0] * p + [1] * g and len(r["input_ids"]) == p + g
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=eos, pad_token_id=tok.pad_token_id)
        ref = ref[0, len(prompt_ids):].tolist()
        ref = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert r["input_ids"][p:] == ref, r["id"]
        assert r["finish_reason"] == ("stop" if ref[-1] == eos else "length")
        assert r["source"] == "toy" and r["backend"] == "hf"

    s = json.loads((out / "summary.json").read_text())
    assert s == json.loads(json.dumps(summary))
    assert s["prompts"] == {"requested": None, "selected": 6, "done_before": 0, "generated": 6,
                            "too_long": 1, "malformed": 3, "empty": 1, "records": 11}
    assert s["per_source"]["toy"]["issues"] == {"bad_json": 1, "missing_field": 1, "not_utf8": 1}
    gen_lens = sorted(r["gen_len"] for r in rows)
    assert s["dataset"]["rows"] == 6 and s["dataset"]["gen_tokens"] == sum(gen_lens)
    assert s["dataset"]["gen_len"]["max"] == gen_lens[-1]
    assert s["dataset"]["truncated"] == sum(r["finish_reason"] == "length" for r in rows)

    # Rerun with the same out: everything is done, nothing is generated or duplicated.
    again = run(make_cfg(target__path=str(toy["plain"]), sources=[{"path": str(path)}], out=str(out),
                         hf__batch_size=4, max_prompt_tokens=30))
    assert again["prompts"]["done_before"] == 6 and again["prompts"]["generated"] == 0
    assert len(read_rows(out)) == 6

    # A stop token id: rows are cut just after its first occurrence.
    first = next(r for r in rows if r["gen_len"] >= 3 and r["finish_reason"] == "length")
    stop_tok = first["input_ids"][first["prompt_len"] + 2]
    out2 = tmp_path / "out2"
    run(make_cfg(target__path=str(toy["plain"]), sources=[{"path": str(path)}], out=str(out2),
                 generation__stop_token_ids=[stop_tok], max_prompt_tokens=30))
    row = next(r for r in read_rows(out2) if r["id"] == first["id"])
    gen = first["input_ids"][first["prompt_len"]:]
    assert row["input_ids"][row["prompt_len"]:] == gen[: gen.index(stop_tok) + 1]
    assert row["finish_reason"] == "stop"
    with pytest.raises(UserError, match="different settings"):
        run(make_cfg(target__path=str(toy["plain"]), sources=[{"path": str(path)}], out=str(out2),
                     max_prompt_tokens=30))


def test_chat_true_without_template_is_an_error(toy, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ValueError, match=f"chat=true but the tokenizer at {toy['plain']} has no"):
        run(make_cfg(target__path=str(toy["plain"]), sources=[{"path": str(path)}], chat=True,
                     out=str(tmp_path / "o")))
    msgs = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"sources\[0\] \(m\): field 'messages' needs a chat"):
        run(make_cfg(target__path=str(toy["plain"]), sources=[{"path": str(msgs), "field": "messages"}],
                     out=str(tmp_path / "o")))
    with pytest.raises(PromptError, match=f"{path}:1: missing field 'question'"):
        run(make_cfg(target__path=str(toy["plain"]), sources=[{"path": str(path), "field": "question"}],
                     strict=True, out=str(tmp_path / "o")))


def test_tokenizer_that_does_not_fit_the_target_is_refused(tmp_path):
    """A target directory holding another model's (larger) tokenizer: one line, before any
    generation; a shard records the tokenizer it was made with (training checks it)."""
    from dflash_lit.tiny.random_targets import save_tiny, tiny_char_tokenizer, tiny_qwen3

    target = save_tiny(tiny_qwen3(vocab_size=64), tmp_path / "t", tokenizer=False)
    tiny_char_tokenizer(128).save_pretrained(target)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    with pytest.raises(ValueError, match=rf"target.path={target}: the tokenizer has 102 tokens but "
                                         r"the target's embedding has vocab_size=64 rows"):
        run(make_cfg(target__path=str(target), sources=[{"path": str(path), "name": "p"}],
                     out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.parquet"))

    from dflash_lit.data.vocab import regenerated_with, tokenizer_fingerprint

    good = save_tiny(tiny_qwen3(vocab_size=64), tmp_path / "good")  # its own 64-token tokenizer
    run(make_cfg(target__path=str(good), sources=[{"path": str(path), "name": "p"}],
                 out=str(tmp_path / "out2")))
    _, recorded = regenerated_with(tmp_path / "out2")
    assert recorded == tokenizer_fingerprint(tiny_char_tokenizer(64))
    assert recorded != tokenizer_fingerprint(tiny_char_tokenizer(128))


def test_unwritable_out_directory_is_one_clear_error(toy, tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    with pytest.raises(OSError, match=rf"out={blocker}/out: cannot create the output directory "
                                      r"\(Not a directory\); choose a writable out="):
        run(make_cfg(target__path=str(toy["plain"]), sources=[{"path": str(path), "name": "p"}],
                     out=str(blocker / "out")))


# -- openai backend --------------------------------------------------------------------------


def test_openai_completions_retries_and_counts(toy, tmp_path, server_factory):
    tok = toy["tok"]
    srv = server_factory(fail_first=2, slow={3}, malformed={4}, truncated={5}, empty={6})
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    out = tmp_path / "out"
    summary = run(make_cfg(target__path=str(toy["plain"]), sources=[{"path": str(path), "name": "p"}],
                           out=str(out), backend="openai", openai__base_url=srv.url,
                           openai__concurrency=2, openai__timeout_s=0.5, rows_per_shard=4))
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == [f"p:{i}" for i in range(1, 7)]
    assert [len(pq.read_table(s)) for s in sorted(out.glob("shard-*.parquet"))] == [4, 2]
    for r in rows:
        prompt_ids = tok(PROMPTS[int(r["id"][2:]) - 1])["input_ids"]
        p = r["prompt_len"]
        gen, finish = expected_openai_gen(tok, prompt_ids)
        assert r["input_ids"] == prompt_ids + gen and r["loss_mask"] == [0] * p + [1] * len(gen)
        assert r["finish_reason"] == finish and r["backend"] == "openai"
    stats = summary["backend_stats"]
    assert stats["http_5xx"] == 2 and stats["timeout"] == 1 and stats["malformed"] == 2
    assert stats["truncated"] == 1  # a body cut off mid-transfer, told apart from a dead server
    assert stats["retries"] == 6 and stats["requests"] == 6 + 6 + 1  # +1: GET /models
    assert json.loads((out / "summary.json").read_text())["backend_stats"] == stats
    assert all(b["model"] == "toy" and b["temperature"] == 0.0 and b["max_tokens"] == 8
               for b in srv.bodies)


def test_openai_chat_endpoint_never_sends_the_original_answer(toy, tmp_path, server_factory):
    tok = toy["tok"]
    srv = server_factory()
    conv = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "ORIG"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": conv}])
    out = tmp_path / "out"
    run(make_cfg(target__path=str(toy["chat"]), sources=[{"path": str(path), "field": "messages"}],
                 out=str(out), backend="openai", openai__base_url=srv.url, openai__model="toy",
                 openai__endpoint="chat"))
    assert srv.bodies[0]["messages"] == conv[:1]
    (row,) = read_rows(out)
    text = tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    gen = tok(fake_text("hello world"), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert row["input_ids"] == prompt_ids + gen and row["prompt_len"] == len(prompt_ids)
    assert "ORIG" not in tok.decode(row["input_ids"])


def test_openai_unreachable_keeps_finished_shards_then_resumes(toy, tmp_path, server_factory):
    tok = toy["tok"]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    out = tmp_path / "out"
    common = dict(target__path=str(toy["plain"]), sources=[{"path": str(path), "name": "p"}],
                  out=str(out), backend="openai", openai__model="toy", openai__concurrency=1,
                  openai__max_retries=2, rows_per_shard=2)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(ServerError, match=f"request to {dead_url}/completions failed after 3 "):
        run(make_cfg(**common, openai__base_url=dead_url))

    dying = server_factory(dead_after=3)
    with pytest.raises(ServerError, match="HTTP 503"):
        run(make_cfg(**common, openai__base_url=dying.url))
    assert len(read_rows(out)) == 3  # one full shard + the flushed partial one
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "failed: ServerError" and s["dataset"]["rows"] == 3

    healthy = server_factory()
    summary = run(make_cfg(**common, openai__base_url=healthy.url))
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == [f"p:{i}" for i in range(1, 7)]
    assert summary["prompts"]["done_before"] == 3 and summary["prompts"]["generated"] == 3
    for r in rows:
        prompt_ids = tok(PROMPTS[int(r["id"][2:]) - 1])["input_ids"]
        assert r["input_ids"] == prompt_ids + expected_openai_gen(tok, prompt_ids)[0]


def test_kill_and_rerun(toy, tmp_path, server_factory):
    srv = server_factory(gate_after=2)  # the 3rd request hangs until the process is killed
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    out = tmp_path / "out"
    overrides = [
        f"target.path='{toy['plain']}'", f"sources=[{{path:'{path}',name:p}}]", f"out='{out}'",
        "backend=openai", f"openai.base_url='{srv.url}'", "openai.model=toy",
        "openai.concurrency=1", "rows_per_shard=2", "generation.max_new_tokens=8",
        "progress=false", f"hydra.run.dir='{tmp_path / 'hydra'}'",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    log = (tmp_path / "child.log").open("w")
    proc = subprocess.Popen([sys.executable, str(REPO / "regenerate.py"), *overrides], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        # Kill once the first shard is on disk and the 3rd request hangs in flight.
        while not ((out / "shard-00000.parquet").exists() and srv.n >= 3):
            assert proc.poll() is None, (tmp_path / "child.log").read_text()
            assert time.time() < deadline, "no shard written in time"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    srv.gate.set()
    first = [r["id"] for r in read_rows(out)]
    assert len(first) == 2 and len(srv.bodies) == 3  # 2 answered, the 3rd killed in flight
    # a kill mid-write leaves the dead process's temporary (the rerun must delete it)
    temporary_name(out / "shard-00001.parquet", pid=proc.pid).write_bytes(b"half a shard")

    healthy = server_factory()
    summary = run(make_cfg(target__path=str(toy["plain"]), sources=[{"path": str(path), "name": "p"}],
                           out=str(out), backend="openai", openai__base_url=healthy.url,
                           openai__model="toy", rows_per_shard=2))
    ids = [r["id"] for r in read_rows(out)]
    assert sorted(ids) == [f"p:{i}" for i in range(1, 7)] and len(ids) == len(set(ids))
    assert summary["prompts"]["done_before"] == 2 and summary["prompts"]["generated"] == 4
    assert not list(out.glob(".*.tmp*"))
    assert len(healthy.bodies) == 4  # only the missing ids were requested
    assert [r["generated"] for r in summary["runs"]] == [4]  # the killed run wrote no summary
    # a rerun with nothing left keeps the record of the runs that generated
    again = run(make_cfg(target__path=str(toy["plain"]), sources=[{"path": str(path), "name": "p"}],
                         out=str(out), backend="openai", openai__base_url=healthy.url,
                         openai__model="toy", rows_per_shard=2))
    assert again["prompts"]["generated"] == 0 and again["runs"] == summary["runs"]
    tok = toy["tok"]
    done_prompts = {tuple(tok(PROMPTS[int(i[2:]) - 1])["input_ids"]) for i in first}
    assert not done_prompts & {tuple(b["prompt"]) for b in healthy.bodies}


def test_hf_segments_drop_stopped_rows_and_equal_one_generate_call(toy, tmp_path):
    """Generated ``segment_tokens`` at a time with stopped rows leaving the batch, every row
    is token for token what one ``generate`` call per batch (and the prompt alone) gives."""
    from collections import Counter

    tok, model = toy["tok"], toy["model"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    common = dict(target__path=str(toy["plain"]), sources=[{"path": str(path)}],
                  hf__batch_size=len(PROMPTS), **{"generation.max_new_tokens": 20})
    run(make_cfg(out=str(tmp_path / "probe"), hf__segment_tokens=None, **common))
    gen = Counter(t for r in read_rows(tmp_path / "probe") for t in r["input_ids"][r["prompt_len"]:])
    stop = gen.most_common(1)[0][0]  # a frequent token as stop: rows end at different steps
    outs = {}
    for seg in (None, 3):
        out = tmp_path / f"seg{seg}"
        run(make_cfg(out=str(out), hf__segment_tokens=seg,
                     **{"generation.stop_token_ids": [stop]}, **common))
        outs[seg] = {r["id"]: r["input_ids"] for r in read_rows(out)}
        lens = sorted(len(r["input_ids"]) - r["prompt_len"] for r in read_rows(out))
    assert outs[3] == outs[None]
    assert lens[0] < 20 and lens[-1] > 3  # some rows stopped early, some ran on past a segment
    eos = {tok.eos_token_id, stop}
    for rid, ids in outs[3].items():
        prompt_ids = tok(PROMPTS[int(rid.split(":")[-1]) - 1])["input_ids"]
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt_ids]), max_new_tokens=20, do_sample=False,
                                 eos_token_id=sorted(eos), pad_token_id=tok.pad_token_id)
        ref = ref[0, len(prompt_ids):].tolist()
        cut = next((k + 1 for k, t in enumerate(ref) if t in eos), len(ref))
        assert ids[len(prompt_ids):] == ref[:cut], rid
