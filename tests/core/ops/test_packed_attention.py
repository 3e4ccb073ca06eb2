"""``sparse_attention_packed_inverse_rope``: attention over V4.1's packed rows is bit for bit attention over the
model's fake-quantized rows (SWA FP8 + ue8m0 per 32, latents FP4 + e4m3 per 16), whichever of the two tensors a
column names; its batch-invariant form conforms and is batch-invariant (tests/core/engine/test_batch_invariance.py
runs every op's)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cpu import CpuBackend
from deepinfer.ops import OpTable
from deepinfer.ops.fake_quant import same_bits
from deepinfer.ops.registry import OpSample
from deepinfer.testing import check_batch_invariance, check_op

OPS = OpTable()
NAME = "sparse_attention_packed_inverse_rope"


def _case(dtype, tokens=3, heads=4, dim=64, rings=40, entries=24, width=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-10, 6, (rings + entries, 1), generator=gen))
    values = (torch.randn(rings + entries, dim, generator=gen) * spread).to(dtype)
    indices = torch.randint(0, rings + entries, (tokens, width), generator=gen)
    indices[torch.rand(tokens, width, generator=gen) < 0.3] = -1
    indices[:, 0] = torch.tensor([0, rings + entries - 1, min(rings, rings + entries - 1)])[:tokens]  # both ends
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    rope = (torch.randint(0, 1 << 16, (tokens,), generator=gen), torch.rand(8, generator=gen), 1.0)
    return q, values, indices, torch.randn(heads, generator=gen), rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_attend_as_the_fake_quantized_rows(dtype):
    q, values, indices, sinks, rope = _case(dtype)
    rings, entries = values[:40], values[40:]
    fake = torch.cat([OPS.fp8_e4m3_fake_quant(rings, 32), OPS.fp4_e2m1_fake_quant(entries, 16, "e4m3")])
    expected = OPS.sparse_attention_inverse_rope(q, fake, indices, sinks, 64**-0.5, *rope)
    got = OPS.sparse_attention_packed_inverse_rope(q, OPS.fp8_e4m3_pack(rings, 32),
                                                   OPS.fp4_e2m1_pack(entries, 16, "e4m3"), 40, indices, sinks,
                                                   64**-0.5, *rope, 32, 16, "e4m3")
    same_bits(got, expected, OpSample((), label="packed"), dtype)


def test_rings_only():
    """A sliding-only layer: no entry rows at all."""
    q, values, indices, sinks, rope = _case(torch.bfloat16, entries=0)
    expected = OPS.sparse_attention_inverse_rope(q, OPS.fp8_e4m3_fake_quant(values, 32), indices, sinks, 0.1, *rope)
    empty = torch.empty(0, 36, dtype=torch.uint8)
    got = OPS.sparse_attention_packed_inverse_rope(q, OPS.fp8_e4m3_pack(values, 32), empty, 40, indices, sinks, 0.1,
                                                   *rope, 32, 16, "e4m3")
    same_bits(got, expected, OpSample((), label="rings only"), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_samples_conform_and_are_batch_invariant(dtype):
    assert check_op(CpuBackend(), NAME, dtype) > 0
    assert check_batch_invariance(CpuBackend(), NAME, dtype) > 0


INDEXER_OPS = ("indexer_topk_packed", "indexer_candidates_packed", "indexer_topk_in_blocks_packed")


def test_packed_indexer_keys_score_as_the_fake_quantized_keys():
    """The indexer over packed FP4 keys (ue8m0 per 32, rows scattered over the pages) picks what it picks over the
    model's fake-quantized keys, bit for bit (the same scores)."""
    gen = torch.Generator().manual_seed(3)
    q, w = torch.randn(5, 8, 64, generator=gen), torch.randn(5, 8, generator=gen)
    keys = torch.randn(2, 30, 64, generator=gen)
    seq_ids, limits = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([30, 12, 30, 29, 3])
    rows = torch.randperm(70, generator=gen)[:60].view(2, 30)
    pages = torch.zeros(70, 34, dtype=torch.uint8)
    pages[rows.flatten()] = OPS.fp4_e2m1_pack(keys.flatten(0, 1), 32, "ue8m0")
    fake = OPS.fp4_e2m1_fake_quant(keys, 32, "ue8m0")
    common = (seq_ids, limits, 6, 0.125, 0.3)
    packed = (q, w, pages, rows, 32, "ue8m0")
    assert torch.equal(OPS.indexer_topk_packed(*packed, *common), OPS.indexer_topk(q, w, fake, *common))
    got = OPS.indexer_candidates_packed(*packed, *common, 4, 3)
    want = OPS.indexer_candidates(q, w, fake, *common, 4, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(OPS.indexer_topk_in_blocks_packed(*packed, *common, want[1], 4),
                       OPS.indexer_topk_in_blocks(q, w, fake, *common, want[1], 4))


@pytest.mark.parametrize("name", INDEXER_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_indexer_samples_conform_and_are_batch_invariant(name, dtype):
    assert check_op(CpuBackend(), name, dtype) > 0
    assert check_batch_invariance(CpuBackend(), name, dtype) > 0
