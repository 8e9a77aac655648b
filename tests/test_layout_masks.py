"""Batched block layout == naive per-block reference, for every mask backend, with and
without a sliding window over the context."""

import dataclasses
import warnings

import pytest
import torch

from dflash_lit import DFlashConfig, DFlashDrafter
from dflash_lit.data.anchors import anchor_candidates
from dflash_lit.model.block_forward import draft_hidden
from dflash_lit.model.layout import IGNORE, build_layout
from dflash_lit.model.masks import dense_mask
from dflash_lit.model.reference import reference_draft_hidden
from dflash_lit.train.anchors import sample_anchors, step_generator

WINDOW = 6  # < most anchors of random_setup's 40-token rows: the window cuts the context


def random_setup(seed: int, b=3, s=40, bs=4, d=32, k=2, max_anchors=6, window=None):
    g = torch.Generator().manual_seed(seed)
    cfg = DFlashConfig(hidden_size=d, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64, num_hidden_layers=2, block_size=bs,
                       mask_token_id=1, num_target_layers=6, target_layer_ids=[1, 4][:k],
                       vocab_size=50, sliding_window=window)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).eval()
    embed = torch.nn.Embedding(50, d)
    lengths = torch.tensor([s, s - 11, s - 23])[:b]
    ids = torch.randint(2, 50, (b, s), generator=g)
    attn = torch.arange(s)[None] < lengths[:, None]
    ids = torch.where(attn, ids, torch.zeros_like(ids))
    # prompt region of random length, then completion; zero on padding
    prompt = torch.randint(3, 10, (b,), generator=g)
    loss_mask = (torch.arange(s)[None] >= prompt[:, None]) & attn
    loss_mask[0, 20:24] = False  # a prompt-like hole inside the completion
    loss_mask[-1, :13] = False  # a short completion: fewer candidates than max_anchors
    th = torch.randn(b, s, k * d, generator=g)
    anchors, valid = sample_anchors(loss_mask.long(), max_anchors, step_generator(seed, 3, 0), attn)
    layout = build_layout(ids, loss_mask.long(), anchors, valid, bs, 1, attn)
    return drafter, embed, th, layout, ids, loss_mask, attn


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("backend", ["dense", "blockwise"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_equals_reference(seed, backend, window):
    drafter, embed, th, layout, *_ = random_setup(seed, window=window)
    with torch.no_grad():
        got = draft_hidden(drafter, embed, th, layout, backend=backend)
        ref = reference_draft_hidden(drafter, embed, th, layout)
    v = layout.valid
    assert v.sum() > 6  # the test covers several blocks, some rows with padding blocks
    assert (~v).any()
    torch.testing.assert_close(got[v], ref[v], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("seed", [0, 3])
def test_flex_equals_dense_and_reference(seed, window):
    drafter, embed, th, layout, *_ = random_setup(seed, window=window)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = draft_hidden(drafter, embed, th, layout, backend="flex")
        dense = draft_hidden(drafter, embed, th, layout, backend="dense")
        ref = reference_draft_hidden(drafter, embed, th, layout)
    v = layout.valid
    torch.testing.assert_close(flex[v], dense[v], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(flex[v], ref[v], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, WINDOW])
def test_blockwise_gradients_equal_dense(window):
    """The CPU training path: same loss gradients as the dense mask, for every parameter."""
    drafter, embed, th, layout, *_ = random_setup(4, window=window)
    drafter.train()
    th = th.requires_grad_(True)
    grads = {}
    for backend in ("dense", "blockwise"):
        drafter.zero_grad()
        th.grad = None
        h = draft_hidden(drafter, embed, th, layout, backend=backend)
        (h[layout.valid] ** 2).mean().backward()
        grads[backend] = [p.grad.clone() for p in drafter.parameters()] + [th.grad.clone()]
    assert len(grads["dense"]) > 10
    for gd, gb in zip(grads["dense"], grads["blockwise"], strict=True):
        torch.testing.assert_close(gb, gd, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_cpu_blockwise_kernel_equals_dense_sdpa(dtype):
    """The CPU blockwise kernel (flash over the context, block part merged by log-sum-exp,
    split-KV backward) equals SDPA over the dense mask and the explicit-score path, forward
    and every input gradient: GQA, padding blocks that see no context, a sliding window."""
    from dflash_lit.model.attention import _blockwise_scores, blockwise_attention
    from dflash_lit.model.masks import blockwise_mask

    *_, layout, _, _, _ = random_setup(5, max_anchors=8, window=WINDOW)
    b, q_len, s = layout.anchors.shape[0], layout.num_blocks * layout.block_size, layout.context_len
    mask = blockwise_mask(layout, WINDOW)
    assert (~mask.context.any(-1)).any()  # some queries see no context key at all
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, 4, q_len, 8, generator=g, dtype=dtype).requires_grad_(True)
    k = torch.randn(b, 2, s + q_len, 8, generator=g, dtype=dtype).requires_grad_(True)
    v = torch.randn(b, 2, s + q_len, 8, generator=g, dtype=dtype).requires_grad_(True)
    grad_out = torch.randn(b, 4, q_len, 8, generator=g, dtype=dtype)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_mask(layout, WINDOW), enable_gqa=True)
    rep = lambda t: t.repeat_interleave(2, dim=1)  # noqa: E731
    outs = {"fused": blockwise_attention(q, k, v, mask),
            "scores": _blockwise_scores(q, rep(k), rep(v), mask), "dense": dense}
    grads = {n: torch.autograd.grad(o, (q, k, v), grad_out) for n, o in outs.items()}
    # float64: exact to rounding against SDPA; the explicit path softmaxes in float32
    tight = {"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else {}
    for name, tol in (("dense", tight), ("scores", {"atol": 2e-6, "rtol": 1e-5})):
        torch.testing.assert_close(outs["fused"], outs[name], **tol)
        for got, ref in zip(grads["fused"], grads[name], strict=True):
            torch.testing.assert_close(got, ref, **tol)


def test_fused_cpu_blockwise_kernel_runs_in_bf16():
    """Under bf16 (autocast on CPUs with native bf16) the kernel keeps its inputs' dtype and
    agrees with float32 to bf16 rounding, forward and gradients."""
    from dflash_lit.model.attention import blockwise_attention
    from dflash_lit.model.masks import blockwise_mask

    *_, layout, _, _, _ = random_setup(5, max_anchors=8)
    b, q_len, s = layout.anchors.shape[0], layout.num_blocks * layout.block_size, layout.context_len
    mask = blockwise_mask(layout)
    g = torch.Generator().manual_seed(1)
    qkv = [torch.randn(b, h, n, 8, generator=g) for h, n in ((4, q_len), (2, s + q_len),
                                                              (2, s + q_len))]
    grad_out = torch.randn(b, 4, q_len, 8, generator=g)
    res = {}
    for dt in (torch.float32, torch.bfloat16):
        leaves = [t.clone().to(dt).requires_grad_(True) for t in qkv]
        out = blockwise_attention(*leaves, mask)
        out.backward(grad_out.to(dt))
        assert out.dtype == dt and all(t.grad.dtype == dt for t in leaves)
        res[dt] = [out.detach().float()] + [t.grad.float() for t in leaves]
    for got, ref in zip(res[torch.bfloat16], res[torch.float32], strict=True):
        torch.testing.assert_close(got, ref, atol=0.05, rtol=0.02)


def test_blockwise_memory_is_linear_in_blocks():
    """The factored mask stores Q·S booleans, the dense one Q·(S+Q)."""
    from dflash_lit.model.masks import blockwise_mask
    *_, layout, _, _, _ = random_setup(0, max_anchors=20)
    dense, bw = dense_mask(layout), blockwise_mask(layout)
    q = layout.num_blocks * layout.block_size
    assert dense.numel() == bw.context.numel() * (layout.context_len + q) // layout.context_len
    assert torch.equal(dense[..., : layout.context_len], bw.context)


def test_block_never_sees_context_at_or_after_anchor():
    drafter, embed, th, layout, *_ = random_setup(5)
    with torch.no_grad():
        base = draft_hidden(drafter, embed, th, layout)
    bi, ni = 0, 2
    a = int(layout.anchors[bi, ni])
    th2 = th.clone()
    th2[bi, a:] += torch.randn_like(th2[bi, a:]) * 5  # the anchor's and all later features
    with torch.no_grad():
        out = draft_hidden(drafter, embed, th2, layout)
    assert torch.equal(out[bi, ni], base[bi, ni])
    # ...but it does see everything before its anchor: perturb position a-1 only
    th3 = th.clone()
    th3[bi, a - 1] += 1.0
    with torch.no_grad():
        out3 = draft_hidden(drafter, embed, th3, layout)
    assert (out3[bi, ni] - base[bi, ni]).abs().max() > 1e-4
    th4 = th.clone()
    th4[bi, 0] += 1.0
    with torch.no_grad():
        out4 = draft_hidden(drafter, embed, th4, layout)
    assert (out4[bi, ni] - base[bi, ni]).abs().max() > 1e-4


def test_window_limits_the_context_to_the_last_window_keys():
    """A block anchored at a sees context [a - window, a): the mask cuts something here, a
    feature just before the window changes nothing, the window's first one does."""
    drafter, embed, th, layout, *_ = random_setup(5, window=WINDOW)
    full, windowed = dense_mask(layout), dense_mask(layout, WINDOW)
    assert (full & ~windowed).any() and not (windowed & ~full).any()
    with torch.no_grad():
        base = draft_hidden(drafter, embed, th, layout)
    bi, ni = 0, 2
    a = int(layout.anchors[bi, ni])
    assert a > WINDOW
    before = th.clone()
    before[bi, : a - WINDOW] += torch.randn_like(before[bi, : a - WINDOW]) * 5
    with torch.no_grad():
        assert torch.equal(draft_hidden(drafter, embed, before, layout)[bi, ni], base[bi, ni])
    first = th.clone()
    first[bi, a - WINDOW] += 1.0
    with torch.no_grad():
        out = draft_hidden(drafter, embed, first, layout)
    assert (out[bi, ni] - base[bi, ni]).abs().max() > 1e-4


def test_window_at_inference_equals_the_explicit_context_slice():
    """Inference (unmasked, cached context fed in pieces) with a window equals the drafter
    given only the window's context, and the same drafter without a window sees more."""
    from dflash_lit.model.drafter import DrafterCache

    drafter, embed, *_ = random_setup(0, window=WINDOW)
    torch.manual_seed(1)
    n, bs = 20, drafter.config.block_size  # context 0..n-1, anchor at n
    th = torch.randn(1, n, drafter.fc.in_features)
    x = torch.randn(1, bs, drafter.config.hidden_size)
    blk = torch.arange(n, n + bs)
    with torch.no_grad():
        cache = DrafterCache()
        drafter(x, th[:, :12], torch.cat([torch.arange(12), torch.arange(12, 12 + bs)])[None],
                cache=cache)
        cached = drafter(x, th[:, 12:], torch.cat([torch.arange(12, n), blk])[None], cache=cache)
        uncached = drafter(x, th, torch.cat([torch.arange(n), blk])[None])
        sliced = drafter(x, th[:, n - WINDOW:], torch.cat([torch.arange(n - WINDOW, n), blk])[None])
        no_window = DFlashDrafter(dataclasses.replace(drafter.config, sliding_window=None))
        no_window.load_state_dict(drafter.state_dict())
        full = no_window(x, th, torch.cat([torch.arange(n), blk])[None])
    torch.testing.assert_close(cached, sliced, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(uncached, sliced, atol=1e-5, rtol=1e-5)
    assert (full - sliced).abs().max() > 1e-4


@pytest.mark.parametrize("window", [0, -3, 3, 2.5, True])
def test_bad_window_is_a_config_error(window):
    with pytest.raises(ValueError, match=rf"sliding_window={window!r}: must be an integer >= block_size=4"):
        random_setup(0, window=window)


def test_blocks_do_not_see_each_other():
    drafter, embed, th, layout, *_ = random_setup(6)
    m = dense_mask(layout)[0, 0]
    s, bs = layout.context_len, layout.block_size
    assert not m[0:bs, s + bs: s + 2 * bs].any() and m[0:bs, s: s + bs].all()
    a0 = int(layout.anchors[0, 0])
    assert m[0, :a0].all() and not m[0, a0:s].any()


def test_anchor_candidates_and_sampling():
    lm = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]])
    cand = anchor_candidates(lm)
    # a >= 1 and loss_mask[a+1] == 1
    assert cand.tolist() == [[False, True, True, True, False, True, True, False]]
    a, v = sample_anchors(lm, 10, step_generator(0, 0, 0))
    assert a[v].tolist() == [1, 2, 3, 5, 6] and v.all()
    a2, v2 = sample_anchors(lm, 3, step_generator(0, 7, 0))
    assert v2.sum() == 3 and set(a2[0].tolist()) <= {1, 2, 3, 5, 6}
    assert a2[0].tolist() == sorted(a2[0].tolist())
    a3, _ = sample_anchors(lm, 3, step_generator(0, 7, 0))
    assert torch.equal(a2, a3)  # pure function of (seed, step, rank)
    draws = {tuple(sample_anchors(lm, 3, step_generator(0, st, 0))[0][0].tolist())
             for st in range(20)}
    assert len(draws) > 3
    with pytest.raises(ValueError, match="max_anchors=0"):
        sample_anchors(lm, 0, step_generator(0, 0, 0))


def test_labels_ignore_prompt_padding_and_end():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    lm = torch.tensor([[0, 0, 1, 1, 0, 1]])
    anchors, valid = torch.tensor([[1, 4]]), torch.tensor([[True, True]])
    lay = build_layout(ids, lm, anchors, valid, 4, 99)
    assert lay.block_ids.tolist() == [[[11, 99, 99, 99], [14, 99, 99, 99]]]
    assert lay.labels.tolist() == [[[IGNORE, 12, 13, IGNORE], [IGNORE, 15, IGNORE, IGNORE]]]
    assert lay.block_pos.tolist() == [[[1, 2, 3, 4], [4, 5, 6, 7]]]
    assert lay.position_ids().tolist() == [[0, 1, 2, 3, 4, 5, 1, 2, 3, 4, 4, 5, 6, 7]]


def test_auto_attention_picks_blockwise_on_cpu_and_flex_on_cuda():
    """attention=auto: the blockwise path on CPU (any shape), flex for CUDA tensors; an
    explicit choice is kept."""
    from types import SimpleNamespace

    from dflash_lit.train.module import DFlashModule

    ids = torch.randint(4, 50, (1, 64))
    anchors = torch.arange(1, 9)[None]
    lay = build_layout(ids, torch.ones_like(ids), anchors, torch.ones_like(anchors).bool(), 8, 1)
    fake = SimpleNamespace(attention="auto")
    assert DFlashModule.attention_backend(fake, lay) == "blockwise"
    on_cuda = SimpleNamespace(anchors=SimpleNamespace(device=torch.device("cuda")))
    assert DFlashModule.attention_backend(fake, on_cuda) == "flex"
    assert DFlashModule.attention_backend(SimpleNamespace(attention="dense"), lay) == "dense"
