"""Undoing a forward on pooled states (kv/rewind.py): after feeding tokens and restoring the checkpoint, the state
continues exactly as if those tokens had never been fed (SWA rings, compressor carry-over and overlap, entries,
indexer keys, Engram history), on V4 and V4.1, across compressor window and ring boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deepinfer
from deepinfer.models import ForwardBatch
from deepinfer.models.loader import load_model
from deepinfer.ops import OpTable
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)
from tests.support.v41_fixtures import FIXTURES

TINY_V4 = Path(deepinfer.__file__).parent / "assets" / "tiny_v4"
MODELS = {"v4": TINY_V4, "v41_a": FIXTURES / "tiny_a", "v41_b": FIXTURES / "tiny_b"}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return load_model(MODELS[request.param], ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))


def _feed(model, state, tokens: list[int]) -> torch.Tensor:
    start = state.num_tokens
    batch = ForwardBatch(torch.tensor(tokens), torch.arange(start, start + len(tokens)), [len(tokens)], [state])
    return model.compute_logits(model.forward(batch))


@pytest.mark.parametrize("prompt_len,junk", [(20, 6), (27, 7), (31, 1), (13, 40)])
def test_restored_state_continues_like_one_that_never_saw_the_tokens(model, prompt_len, junk):
    gen = torch.Generator().manual_seed(prompt_len)
    vocab = model.vocab_size
    prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
    rejected = torch.randint(3, vocab, (junk,), generator=gen).tolist()
    after = torch.randint(3, vocab, (9,), generator=gen).tolist()
    plain, spec = model.new_state(), model.new_state()
    with torch.no_grad():
        _feed(model, plain, prompt)
        _feed(model, spec, prompt)
        ckpt = model.checkpoint([spec], [junk])
        _feed(model, spec, rejected)
        ckpt.restore([0])
        assert spec.num_tokens == prompt_len
        for chunk in (after[:4], after[4:5], after[5:]):  # a chunk, then decode steps
            expected, actual = _feed(model, plain, chunk), _feed(model, spec, chunk)
            assert torch.equal(expected, actual)
    plain.release()
    spec.release()


def test_without_restore_the_state_differs(model):
    """Negative control: the rejected tokens do change what follows (they overwrote the unfinished window's
    carry-over: positions 20, 21 of the window that 22, 23 close)."""
    vocab = model.vocab_size
    plain, spec = model.new_state(), model.new_state()
    prompt = list(range(3, 25))
    with torch.no_grad():
        _feed(model, plain, prompt)
        _feed(model, spec, prompt)
        _feed(model, spec, [(t * 7) % vocab for t in range(5)])
        spec.num_tokens = plain.num_tokens  # a rewind that forgets the carry-over and the rings
        assert not torch.equal(_feed(model, plain, [5, 6]), _feed(model, spec, [5, 6]))


def _feed_many(model, states, chunks: list[list[int]]) -> list[torch.Tensor]:
    ids = torch.tensor([t for c in chunks for t in c])
    pairs = zip(states, chunks, strict=True)
    positions = torch.cat([torch.arange(s.num_tokens, s.num_tokens + len(c)) for s, c in pairs])
    logits = model.compute_logits(model.forward(ForwardBatch(ids, positions, [len(c) for c in chunks], states)))
    return list(logits.split([len(c) for c in chunks]))


def test_one_checkpoint_of_several_states_restores_only_the_chosen(model):
    """Three states checkpointed together and fed in one batch; restoring the first and the last leaves the middle
    one with what it was fed."""
    gen = torch.Generator().manual_seed(3)
    vocab = model.vocab_size
    lengths, junk = [22, 9, 31], [5, 3, 7]
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    fed = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in junk]
    after = [torch.randint(3, vocab, (4,), generator=gen).tolist() for _ in lengths]
    spec = [model.new_state() for _ in lengths]
    plain = [model.new_state() for _ in lengths]
    with torch.no_grad():
        _feed_many(model, spec, prompts)
        _feed_many(model, plain, prompts)
        ckpt = model.checkpoint(spec, junk)
        _feed_many(model, spec, fed)
        ckpt.restore([0, 2])
        _feed_many(model, plain[1:2], fed[1:2])  # the middle one keeps what it was fed
        assert [s.num_tokens for s in spec] == [s.num_tokens for s in plain]
        for expected, actual in zip(_feed_many(model, plain, after), _feed_many(model, spec, after), strict=True):
            torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    for s in spec + plain:
        s.release()
