"""DFlashDrafter: config validation, z-lab IO round-trip, uncached call semantics."""

import json

import pytest
import torch

from dflash_lit import DFlashConfig, DFlashDrafter, default_target_layer_ids

ZLAB_LAYER_NAMES = {
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
}


def tiny_cfg(**kw) -> DFlashConfig:
    base = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, num_hidden_layers=2, block_size=4, mask_token_id=5,
                num_target_layers=8, target_layer_ids=[1, 4, 6], vocab_size=64)
    base.update(kw)
    return DFlashConfig(**base)


def test_default_layer_ids_formula():
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    cfg = DFlashConfig(num_target_layers=8, num_context_layers=5)
    assert cfg.target_layer_ids == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(target_layer_ids=[1, 8]), "out of range"),
        (dict(target_layer_ids=[2, 2]), "duplicates"),
        (dict(mask_token_id=64), "outside the target vocab"),
        (dict(block_size=1), "block_size=1"),
        (dict(num_key_value_heads=3), "not a multiple"),
    ],
)
def test_config_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        tiny_cfg(**kw)


def test_state_dict_names_are_zlab():
    m = DFlashDrafter(tiny_cfg())
    names = set(m.state_dict())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(2) for n in ZLAB_LAYER_NAMES}
    assert names == expected
    sd = m.state_dict()
    assert sd["fc.weight"].shape == (32, 3 * 32)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 32)
    assert sd["layers.1.self_attn.q_norm.weight"].shape == (8,)


def test_save_load_roundtrip_bit_exact(tmp_path):
    torch.manual_seed(0)
    m = DFlashDrafter(tiny_cfg())
    m.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [1, 4, 6]}
    assert cfg["tie_word_embeddings"] is False and cfg["block_size"] == 4
    m2 = DFlashDrafter.from_pretrained(tmp_path)
    for (k, a), (k2, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    x = torch.randn(2, 4, 32)
    th = torch.randn(2, 6, 96)
    pos = torch.arange(10).expand(2, 10)
    assert torch.equal(m(x, th, pos), m2(x, th, pos))


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        DFlashDrafter.from_pretrained(tmp_path)
    m = DFlashDrafter(tiny_cfg())
    m.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.gate_proj\.weight has shape \(48, 32\), "
                       r"the config implies \(40, 32\)"):
        DFlashDrafter.from_pretrained(tmp_path)
    cfg["intermediate_size"] = 48
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_uncached_call_sees_all_context_and_block():
    torch.manual_seed(0)
    m = DFlashDrafter(tiny_cfg()).eval()
    x, th = torch.randn(1, 4, 32), torch.randn(1, 5, 96)
    pos = torch.arange(9)[None]
    base = m(x, th, pos)
    assert base.shape == (1, 4, 32)
    th2 = th.clone()
    th2[0, 0] += 1.0  # every block query depends on the first context token
    assert (m(x, th2, pos) - base).abs().amax(-1).min() > 0
    x2 = x.clone()
    x2[0, 3] += 1.0  # bidirectional: slot 0 depends on the last block slot
    assert (m(x2, th, pos) - base)[0, 0].abs().max() > 0


def test_hidden_size_mismatch_errors():
    m = DFlashDrafter(tiny_cfg())
    with pytest.raises(ValueError, match="target_hidden has last dim 64"):
        m(torch.randn(1, 4, 32), torch.randn(1, 5, 64), torch.arange(9)[None])
    with pytest.raises(ValueError, match="hidden size 16"):
        m(torch.randn(1, 4, 16), torch.randn(1, 5, 96), torch.arange(9)[None])


def test_cache_matches_uncached():
    """Drafting with cached committed context equals the uncached call on the full context."""
    from dflash_lit.model.drafter import DrafterCache

    torch.manual_seed(0)
    m = DFlashDrafter(tiny_cfg()).eval()
    th = torch.randn(1, 9, 96)
    x = torch.randn(1, 4, 32)
    full = m(x, th, torch.cat([torch.arange(9), torch.arange(9, 13)])[None])
    cache = DrafterCache()
    m(x, th[:, :6], torch.cat([torch.arange(6), torch.arange(6, 10)])[None], cache=cache)
    assert cache.length == 6
    out = m(x, th[:, 6:], torch.cat([torch.arange(6, 9), torch.arange(9, 13)])[None], cache=cache)
    assert cache.length == 9
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
