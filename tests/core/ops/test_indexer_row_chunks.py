"""The reference indexer ops score queries in row chunks of bounded size (a long prompt's chunk would otherwise
gather keys for every query at once: ~100 GiB at 700k tokens); chunked and whole give the same selections."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import indexer, op_defs

OPS = ["indexer_topk", "indexer_candidates", "indexer_topk_in_blocks"]


def _ops_and_samples():
    for name in OPS:
        ref = op_defs()[name]
        assert ref.sample_inputs is not None and ref.batch_invariant is not None
        for form in (ref.reference, ref.batch_invariant):
            gen = torch.Generator().manual_seed(0)
            for sample in ref.sample_inputs(torch.float32, gen):
                yield pytest.param(form, sample, id=f"{form.__name__}-{sample.label}")


@pytest.mark.parametrize(("fn", "sample"), list(_ops_and_samples()))
def test_chunked_rows_select_what_whole_rows_do(monkeypatch, fn, sample):
    whole = fn(*sample.args, **sample.kwargs)
    monkeypatch.setattr(indexer, "ROW_CHUNK_BYTES", 1)  # 16 rows a chunk
    chunked = fn(*sample.args, **sample.kwargs)
    for a, b in zip(whole if isinstance(whole, tuple) else (whole,), chunked if isinstance(chunked, tuple)
                    else (chunked,), strict=True):
        assert torch.equal(a, b)


def test_row_chunks_are_bounded():
    seen = []
    keys = torch.zeros(1, 1 << 14, 64)
    rows = torch.arange(1000)
    indexer.by_row_chunks(lambda r: seen.append(len(r)) or r, keys, 8, rows)
    assert max(seen) * 4 * keys.shape[1] * keys.shape[2] <= indexer.ROW_CHUNK_BYTES and sum(seen) == 1000
