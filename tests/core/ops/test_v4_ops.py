"""The V4 reference ops: properties each must have, and the conformance machinery run on each of them
(the CPU backend against the reference, which exercises every custom comparison)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cpu import CpuBackend
from deepinfer.ops import OpTable, op_defs
from deepinfer.testing import check_op

V4_OPS = ["linear", "grouped_linear", "embedding", "rope", "hc_pre", "hc_post", "hc_head", "compress_pool",
          "compress_entries", "indexer_topk", "sparse_attention", "moe_router", "moe_hash_router", "swiglu_mlp",
          "moe_experts", "dequant_fp8_block", "dequant_mxfp4"]
OPS = OpTable()


@pytest.mark.parametrize("name", V4_OPS)
def test_conformance_suite_runs_on_every_v4_op(name):
    assert name in op_defs()
    for dtype in op_defs()[name].dtypes:
        assert check_op(CpuBackend(), name, dtype) > 0


def test_rope_inverse_undoes_rope_and_leaves_leading_channels():
    x = torch.randn(5, 3, 32)
    pos = torch.tensor([0, 1, 7, 100, 5000])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    y = OPS.rope(x, pos, inv_freq)
    torch.testing.assert_close(y[..., :24], x[..., :24], rtol=0, atol=0)
    torch.testing.assert_close(y[0], x[0])  # position 0 is the identity
    torch.testing.assert_close(OPS.rope(y, pos, inv_freq, inverse=True), x, atol=1e-5, rtol=1e-5)
    # interleaved pairs rotate like complex numbers: (a + ib) * e^{i p f}
    angle = pos[3] * inv_freq[1]
    pair = torch.complex(x[3, 0, 26], x[3, 0, 27]) * torch.exp(1j * angle)
    torch.testing.assert_close(y[3, 0, 26:28], torch.stack([pair.real, pair.imag]).float(), atol=1e-5, rtol=1e-5)


def test_hc_pre_comb_is_doubly_stochastic_and_collapse_uses_pre():
    gen = torch.Generator().manual_seed(0)
    streams = torch.randn(6, 4, 32, generator=gen)
    fn, base = torch.randn(24, 128, generator=gen) * 0.1, torch.randn(24, generator=gen)
    collapsed, post, comb = OPS.hc_pre(streams, fn, base, torch.ones(3), 1e-6, 1e-6, 20)
    torch.testing.assert_close(comb.sum(-2), torch.ones(6, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(6, 4), atol=1e-3, rtol=0)
    assert ((post > 0) & (post < 2)).all()
    # with `fn` zero the mixes are the biases alone: pre = sigmoid(base) + eps
    collapsed0, _, _ = OPS.hc_pre(streams, torch.zeros_like(fn), base, torch.ones(3), 1e-6, 1e-6, 20)
    pre = torch.sigmoid(base[:4]) + 1e-6
    torch.testing.assert_close(collapsed0, (pre[None, :, None] * streams).sum(1))


def test_indexer_topk_masks_the_future_and_breaks_ties_towards_earlier_entries():
    q = torch.ones(3, 2, 4)
    keys = torch.ones(1, 6, 4)  # every entry scores the same: a full tie
    keys[0, 4] = 2.0  # except entry 4, which scores highest
    seq_ids = torch.zeros(3, dtype=torch.int64)
    limits = torch.tensor([0, 3, 6])
    picks = OPS.indexer_topk(q, torch.ones(3, 2), keys, seq_ids, limits, 4, 1.0, 1.0)
    assert picks.tolist() == [[-1, -1, -1, -1], [0, 1, 2, -1], [4, 0, 1, 2]]


def test_sparse_attention_equals_dense_attention_with_sink():
    gen = torch.Generator().manual_seed(1)
    q, kv = torch.randn(4, 2, 8, generator=gen), torch.randn(10, 8, generator=gen)
    indices = torch.tensor([[0, 1, -1], [2, -1, -1], [3, 4, 5], [-1, -1, -1]])
    sinks = torch.tensor([0.5, -1.0])
    out = OPS.sparse_attention(q, kv, indices, sinks, 0.3)
    for t in range(4):
        rows = indices[t][indices[t] >= 0]
        logits = torch.cat([0.3 * q[t] @ kv[rows].T, sinks[:, None]], dim=1)
        probs = torch.softmax(logits, dim=1)[:, :-1]
        torch.testing.assert_close(out[t], probs @ kv[rows])
    assert (out[3] == 0).all()  # nothing to attend to but the sink


def test_compress_pool_ignores_empty_slots():
    kv, score = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    score[0, :2] = float("-inf")
    out = OPS.compress_pool(kv, score)
    torch.testing.assert_close(out[0], (torch.softmax(score[0, 2:], 0) * kv[0, 2:]).sum(0))


def test_compress_entries_pool_the_overlap_window_then_norm_and_rotate():
    """CSA: an entry pools the predecessor's series a and the window's series b; without a predecessor only b
    (whatever ``previous`` holds); then RMSNorm and RoPE at the entry's position."""
    gen = torch.Generator().manual_seed(3)
    n, r, dim = 3, 2, 8
    window, previous = torch.randn(n, r, 4 * dim, generator=gen), torch.randn(n, r, 2 * dim, generator=gen)
    bias, weight = torch.randn(r, 2 * dim, generator=gen), 1 + 0.1 * torch.randn(dim, generator=gen)
    positions, inv_freq = torch.tensor([0, 2, 4]), torch.tensor([1.0, 0.1])
    has_previous = torch.tensor([False, True, True])
    out = OPS.compress_entries(window, previous, has_previous, bias, weight, 1e-6, positions, inv_freq, 1.0)
    for i in range(n):
        kv_b, score_b = window[i, :, dim : 2 * dim], window[i, :, 3 * dim :] + bias[:, dim:]
        kv, score = kv_b, score_b
        if has_previous[i]:
            kv = torch.cat([previous[i, :, :dim], kv_b])
            score = torch.cat([previous[i, :, dim:] + bias[:, :dim], score_b])
        pooled = (torch.softmax(score, 0) * kv).sum(0)
        normed = pooled * torch.rsqrt(pooled.pow(2).mean() + 1e-6) * weight
        expected = OPS.rope(normed[None], positions[i : i + 1], inv_freq)[0]
        torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=1e-5)
    other = OPS.compress_entries(window, torch.randn(n, r, 2 * dim, generator=gen), has_previous, bias, weight,
                                 1e-6, positions, inv_freq, 1.0)
    assert torch.equal(other[0], out[0]) and not torch.equal(other[1], out[1])


def test_moe_experts_sum_routed_clamped_swiglu():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 8, generator=gen) * 4
    w13, w2 = torch.randn(4, 10, 8, generator=gen), torch.randn(4, 8, 5, generator=gen)
    ids, weights = torch.tensor([[1, 3], [0, 0], [2, 1]]), torch.rand(3, 2, generator=gen)
    out = OPS.moe_experts(x, ids, weights, w13, w2, 1.0)
    for t in range(3):
        expected = 0
        for j in range(2):
            g, u = (w13[ids[t, j]] @ x[t]).chunk(2)
            h = torch.nn.functional.silu(g.clamp(max=1.0)) * u.clamp(-1.0, 1.0)
            expected = expected + weights[t, j] * (w2[ids[t, j]] @ h)
        torch.testing.assert_close(out[t], expected, atol=1e-5, rtol=1e-5)


def test_router_selects_with_bias_but_weighs_without():
    x, w = torch.eye(4), torch.eye(4) * 3  # expert e's logit is 3 for token e, else 0
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    weights, ids = OPS.moe_router(x, w, bias, 2, 1.5, "sqrtsoftplus")
    assert ids[0].sort().values.tolist() == [0, 3]  # the bias drags expert 3 in everywhere
    s = torch.nn.functional.softplus(torch.tensor([3.0, 0.0])).sqrt()
    torch.testing.assert_close(weights[0].sort(descending=True).values, (s / s.sum() * 1.5))
