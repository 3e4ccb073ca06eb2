"""Per-sequence state of DeepSeek-V4: the same whatever the chunking, forkable, and bounded by state_bytes."""

from __future__ import annotations

import pytest
import torch

from deepinfer.models import ForwardBatch, SequenceState, load_model
from deepinfer.models.deepseek_v4.state import layer_view
from deepinfer.ops import OpTable
from tests.support.v4_fixtures import SMALL, build_checkpoint, random_tokens, single_thread  # noqa: F401


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = build_checkpoint(tmp_path_factory.mktemp("v4"), SMALL, seed=3)
    return load_model(path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))


def feed(model, state, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for start in range(0, len(tokens), chunk):
            ids = tokens[start : start + chunk]
            pos = torch.arange(state.num_tokens, state.num_tokens + len(ids))
            out.append(model.compute_logits(model.forward(ForwardBatch(ids, pos, [len(ids)], [state]))))
    return torch.cat(out)


def test_state_is_the_same_whatever_the_chunking(model):
    tokens = random_tokens(70, SMALL["vocab_size"], seed=4)
    whole, steps = model.new_state(), model.new_state()
    feed(model, whole, tokens, 70)
    feed(model, steps, tokens, 1)
    assert isinstance(whole, SequenceState) and whole.num_tokens == steps.num_tokens == 70
    for i, (kind, ratio) in enumerate(zip(model.config.layer_types, model.config.compress_ratios, strict=True)):
        a, b = layer_view(whole, i), layer_view(steps, i)
        torch.testing.assert_close(a.swa_ring, b.swa_ring, atol=1e-5, rtol=0)
        for ta, tb in ((a.entries, b.entries), (a.pending_kv, b.pending_kv), (a.index_keys, b.index_keys)):
            assert (ta is None) == (tb is None)
            if ta is not None:
                torch.testing.assert_close(ta, tb, atol=1e-5, rtol=0)
        if a.entries is not None:
            assert a.entries.shape[0] == 70 // ratio and a.pending_kv.shape[0] == 70 % ratio
            assert (a.index_keys is not None) == (kind == "compressed_sparse_attention")
    assert whole.nbytes() == steps.nbytes()


def test_fork_is_independent(model):
    prompt = random_tokens(45, SMALL["vocab_size"], seed=5)
    tail_a, tail_b = random_tokens(20, SMALL["vocab_size"], seed=6), random_tokens(20, SMALL["vocab_size"], seed=7)
    state = model.new_state()
    feed(model, state, prompt, 45)
    child = state.fork()
    assert child.num_tokens == 45 and child.nbytes() == state.nbytes()
    got_b = feed(model, child, tail_b, 3)
    got_a = feed(model, state, tail_a, 20)
    for tail, got in ((tail_a, got_a), (tail_b, got_b)):
        fresh = feed(model, model.new_state(), torch.cat([prompt, tail]), 65)[45:]
        torch.testing.assert_close(got, fresh, atol=1e-5, rtol=0)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 63, 64, 150])
def test_nbytes_within_state_bytes(model, length):
    state = model.new_state()
    assert state.nbytes() == 0 and model.state_bytes(0) == 0
    feed(model, state, random_tokens(length, SMALL["vocab_size"], seed=length), 7)
    assert 0 < state.nbytes() <= model.state_bytes(length)
    assert model.state_bytes(length) <= model.state_bytes(length + 64)
