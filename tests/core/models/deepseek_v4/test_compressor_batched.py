"""A ragged step's compressor gives the same entries and carry-over whether it assembles every sequence's windows
in one batch (many sequences: mixed steps) or sequence by sequence (a prefill of one or two)."""

from types import SimpleNamespace

import pytest
import torch

from deepinfer.kv.layout import RaggedLayout
from deepinfer.kv.ragged_plan import prefill_plan
from deepinfer.layers import compressor as compressor_module
from deepinfer.models.deepseek_v4.compressor import Compressor
from deepinfer.models.deepseek_v4.state import CompressorCache
from deepinfer.ops import OpTable

WINDOW, PAGE, BASE, SLOTS = 8, 4, 40, 9
# (start, new tokens): fresh prefills, continued chunks with held tokens, decode rows that close or do not close a
# window, a chunk that closes none, one that spans several windows and leaves tokens over.
CHUNKS = [(0, 11), (5, 1), (7, 1), (13, 6), (2, 1), (0, 2), (30, 9), (3, 5)]


@pytest.mark.parametrize("ratio, overlap", [(4, True), (4, False), (8, False)], ids=["csa", "ratio4", "hca_like"])
def test_batched_and_per_sequence_windows_agree(ratio, overlap, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    dim = 16
    width = 2 * dim if overlap else dim
    starts, lens = [s for s, _ in CHUNKS], [n for _, n in CHUNKS]
    slots = list(range(1, len(CHUNKS) + 1))
    comp = Compressor(OpTable(), torch.randn(ratio, width, generator=gen), 1 + 0.1 * torch.randn(dim, generator=gen),
                      ratio=ratio, overlap=overlap, eps=1e-6, inv_freq=torch.rand(4, generator=gen), rope_scaling=1.0)
    proj = torch.randn(sum(lens), 2 * width, generator=gen)
    layout = RaggedLayout.build(lens, starts, lambda t: t)
    pages = torch.arange(len(CHUNKS) * 3).view(len(CHUNKS), 3) + 1  # 3 pages of entries per sequence
    layout.entry_rows = {ratio: (pages[:, :, None] * PAGE + torch.arange(PAGE)).flatten(1)}
    positions = torch.cat([torch.arange(s, s + n) for s, n in CHUNKS])
    layout.plans = {ratio: prefill_plan(layout, slots, positions, WINDOW, ratio, BASE, lambda t: t)}
    states = [SimpleNamespace(slot=s) for s in slots]
    start_cache = _zeros(ratio, dim, overlap)
    start_cache.pending.normal_(generator=gen)
    if overlap:
        start_cache.overlap.normal_(generator=gen)

    results = []
    for batched_from in (len(CHUNKS), 0):  # per sequence, then in one batch
        monkeypatch.setattr(compressor_module, "BATCHED_FROM", batched_from)
        cache = _zeros(ratio, dim, overlap)
        cache.pending.copy_(start_cache.pending)
        if overlap:
            cache.overlap.copy_(start_cache.overlap)
        out = torch.zeros(BASE + 40 * PAGE, dim)
        comp(proj, layout, states, cache, out, kv_rows=True)
        results.append((out, cache))
    (out_a, cache_a), (out_b, cache_b) = results
    assert len(layout.plans[ratio].closed_positions) >= 5  # the case closes windows in most sequences
    assert torch.equal(out_a, out_b) and out_a.abs().sum() > 0
    for slot, (start, n) in zip(slots, CHUNKS, strict=True):  # the carry-over rows that are live after the step
        held = (start + n) % ratio
        assert torch.equal(cache_a.pending[slot, :held], cache_b.pending[slot, :held]), slot
    if overlap:
        assert torch.equal(cache_a.overlap, cache_b.overlap)


def _zeros(ratio: int, dim: int, overlap: bool) -> CompressorCache:
    width = 2 * dim if overlap else dim
    overlap_rows = torch.zeros(SLOTS, ratio, 2 * dim) if overlap else None
    return CompressorCache(torch.zeros(SLOTS, ratio, 2 * width), overlap_rows)
