"""FrozenTarget: layer capture == HF hidden_states[i+1] exactly, frozen, early stop, loading."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dflash_lit.model.target import FrozenTarget, TargetOutput
from dflash_lit.tiny.random_targets import (
    BOS_ID,
    EOS_ID,
    MASK_ID,
    PAD_ID,
    save_tiny,
    tiny_hybrid,
    tiny_llama,
    tiny_qwen3,
)

# llama: tied embeddings (lm_head.weight is embed_tokens.weight), the SmolLM2 layout
BUILDERS = {"qwen3": tiny_qwen3, "hybrid": tiny_hybrid, "llama": tiny_llama}
L = 8  # decoder layers of the tiny targets


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def model(request):
    return BUILDERS[request.param]()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(4, 128, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0  # right padding
    mask[2, 6:] = 0
    ids = ids.masked_fill(mask == 0, PAD_ID)
    return ids, mask


def _hf(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, output_hidden_states=True)


@pytest.mark.parametrize("layer_ids", [[0, 2, 5], [6, 1, 3], [1, 4, 7], [7]])
@pytest.mark.parametrize("with_mask", [True, False])
def test_layers_and_logits_equal_hf(model, batch, layer_ids, with_mask):
    ids, mask = batch
    mask = mask if with_mask else None
    ref = _hf(model, ids, mask)
    out = FrozenTarget(model, layer_ids)(ids, attention_mask=mask)
    assert isinstance(out, TargetOutput)
    assert out.hidden.shape == (3, 20, 64 * len(layer_ids))
    for k, i in enumerate(layer_ids):
        # id L-1 is HF's hidden_states[L], i.e. the final-norm output.
        assert torch.equal(out.layers[k], ref.hidden_states[i + 1]), f"layer {i}"
    assert torch.equal(out.hidden, torch.cat([ref.hidden_states[i + 1] for i in layer_ids], -1))
    assert torch.equal(out.logits, ref.logits)
    assert out.cache is None


def test_last_layer_id_is_final_norm_output(model, batch):
    ids, mask = batch
    ref = _hf(model, ids, mask)
    pre_norm = []
    h = model.model.layers[L - 1].register_forward_hook(lambda m, a, o: pre_norm.append(o))
    try:
        out = FrozenTarget(model, [L - 1])(ids, attention_mask=mask, need_logits=False)
    finally:
        h.remove()
    assert out.logits is None
    assert torch.equal(out.hidden, ref.hidden_states[L])
    assert torch.equal(out.hidden, model.model.norm(pre_norm[0]))


def test_early_stop_same_hidden_and_skips_later_layers(model, batch):
    ids, mask = batch
    target = FrozenTarget(model, [3, 1])
    hooks_before = [len(layer._forward_hooks) for layer in model.model.layers]
    calls = {"layer4": 0, "norm": 0, "lm_head": 0}

    def counter(name):
        def hook(*_):
            calls[name] += 1

        return hook

    handles = [
        model.model.layers[4].register_forward_hook(counter("layer4")),
        model.model.norm.register_forward_hook(counter("norm")),
        model.lm_head.register_forward_hook(counter("lm_head")),
    ]
    try:
        full = target(ids, attention_mask=mask, need_logits=True)
        assert calls == {"layer4": 1, "norm": 1, "lm_head": 1}
        early = target(ids, attention_mask=mask, need_logits=False)
        assert calls == {"layer4": 1, "norm": 1, "lm_head": 1}  # nothing past layer 3 ran
    finally:
        for h in handles:
            h.remove()
    assert early.logits is None
    assert torch.equal(early.hidden, full.hidden)
    ref = _hf(model, ids, mask)
    assert torch.equal(early.hidden, torch.cat([ref.hidden_states[4], ref.hidden_states[2]], -1))
    # No capture hook is left behind, even after the early-stop exception (HF keeps its own).
    assert [len(layer._forward_hooks) for layer in model.model.layers] == hooks_before


def test_right_padding_does_not_change_valid_positions(model, batch):
    ids, mask = batch
    target = FrozenTarget(model, [2, 6])
    padded = target(ids, attention_mask=mask)
    alone = target(ids[1:2, :13])  # row 1 without its padding
    torch.testing.assert_close(padded.hidden[1:2, :13], alone.hidden, rtol=0, atol=1e-5)
    torch.testing.assert_close(padded.logits[1:2, :13], alone.logits, rtol=0, atol=1e-5)


def test_frozen_no_grad_and_eval(model, batch):
    ids, mask = batch
    target = FrozenTarget(model, [1, 5])
    assert all(not p.requires_grad for p in target.parameters())
    target.train()
    assert target.train(True) is target
    assert not target.training and not any(m.training for m in target.modules())
    with torch.enable_grad():
        out = target(ids, attention_mask=mask)
    for t in (out.hidden, out.logits, *out.layers):
        assert t.grad_fn is None and not t.requires_grad
    # The drafter calls embed_tokens / lm_head with grad on: grads reach its inputs, not weights.
    x = torch.randn(2, 5, 64, requires_grad=True)
    target.lm_head(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert target.lm_head.weight.grad is None
    assert target.embed_tokens(ids).grad_fn is None


def test_properties_and_state_dict(model):
    target = FrozenTarget(model, [0, 4])
    assert (target.hidden_size, target.num_layers, target.vocab_size) == (64, L, 128)
    assert target.device == torch.device("cpu") and target.dtype == torch.float32
    assert target.embed_tokens is model.get_input_embeddings()
    assert target.lm_head is model.lm_head and isinstance(target.lm_head, torch.nn.Linear)
    assert target.config is model.config
    assert target.layer_ids == [0, 4]
    # Internal references are not re-registered: each weight appears once, under model.*.
    assert list(target.state_dict()) == [f"model.{k}" for k in model.state_dict()]


@pytest.mark.parametrize(
    "bad, words",
    [
        ([8], ["[8]", "8 decoder layers", "0..7"]),
        ([-1, 2], ["[-1]", "8 decoder layers"]),
        ([1, 3, 1], ["[1]", "more than once"]),
        ([], ["empty"]),
        ([1.0], ["not integers"]),
    ],
)
def test_bad_layer_ids_raise(bad, words):
    model = tiny_qwen3(num_layers=L)
    with pytest.raises(ValueError) as exc:
        FrozenTarget(model, bad)
    for w in words:
        assert w in str(exc.value)


def test_from_pretrained_round_trip(model, batch, tmp_path):
    ids, mask = batch
    save_tiny(model, tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    loaded = FrozenTarget.from_pretrained(tmp_path, [1, 7], dtype=torch.float32, device="cpu")
    assert type(loaded.model) is type(model)
    ref = FrozenTarget(model, [1, 7])(ids, attention_mask=mask)
    out = loaded(ids, attention_mask=mask)
    assert torch.equal(out.hidden, ref.hidden) and torch.equal(out.logits, ref.logits)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tok.mask_token_id == MASK_ID
    text = "def add(a, b):\n    return a + b"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert max(tok(text)["input_ids"]) < 128


def test_tiny_builders_deterministic_and_shaped():
    state = torch.random.get_rng_state()
    a, b, c = tiny_hybrid(seed=0), tiny_hybrid(seed=0), tiny_hybrid(seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(
        sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"]
    )
    full = [i for i, t in enumerate(a.config.layer_types) if t == "full_attention"]
    assert full == [3, 7]
    assert hasattr(a.model.layers[0], "linear_attn") and hasattr(a.model.layers[3], "self_attn")
    for m in (a, tiny_qwen3()):
        cfg = m.config
        assert max(cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id, MASK_ID) < cfg.vocab_size
        assert not cfg.tie_word_embeddings


def test_generic_llama_layout():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    llama = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 64, (2, 9))
    ref = _hf(llama, ids, None)
    out = FrozenTarget(llama, [0, 2])(ids)
    assert torch.equal(out.layers[0], ref.hidden_states[1])
    assert torch.equal(out.layers[1], ref.hidden_states[3])
    with pytest.raises(ValueError, match="3 decoder layers"):
        FrozenTarget(llama, [3])


def test_cache_passthrough_for_incremental_decoding(model):
    """Extra kwargs reach the HF model: prefill + cached step == one full forward (eval use)."""
    ids = torch.randint(4, 128, (1, 12), generator=torch.Generator().manual_seed(7))
    target = FrozenTarget(model, [1, 3])
    pre = target(ids[:, :8], use_cache=True)
    assert pre.cache is not None and pre.cache.get_seq_length() == 8
    step = target(
        ids[:, 8:], use_cache=True, cache=pre.cache, position_ids=torch.arange(8, 12)[None]
    )
    full = target(ids)
    torch.testing.assert_close(step.hidden, full.hidden[:, 8:], rtol=0, atol=1e-5)
    torch.testing.assert_close(step.logits, full.logits[:, 8:], rtol=0, atol=1e-5)
