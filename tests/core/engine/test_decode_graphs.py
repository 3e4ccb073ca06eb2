"""Decode steps replayed from captured graphs (``runner/decode_graphs.py``) give what eager steps give.

The CPU backend's ``graph_capture`` replays eagerly; ``CapturingBackend`` below behaves like CUDA graphs
instead: capturing runs the step twice (warm-up and capture) on whatever the static buffers hold, and a replay
re-runs it on the buffers' current contents.  The engine must give the same tokens and logprobs as
``enforce_eager=True`` — which only holds if capturing touches no sequence's state (it runs on padding rows:
the pool's null slot and page) and every step reads its inputs from the static buffers.
"""

from __future__ import annotations

import contextlib

import pytest

from deepinfer import LLM
from deepinfer.backends import Backend
from tests.support.engine_checks import assert_same_output, mixed_params, ragged_prompts
from tests.support.v4_fixtures import SMALL, build_engine_checkpoint
from tests.support.v41_fixtures import FIXTURES

MAX_TOKENS = 16


class CapturingBackend(Backend):
    name = "capturing"

    def __init__(self) -> None:
        self.captures = 0

    @contextlib.contextmanager
    def graph_capture(self, device):
        def capture(fn):
            fn()  # warm-up
            fn()  # "capture"
            self.captures += 1
            return fn

        yield capture


@pytest.fixture(scope="module", params=["deepseek_v4", "deepseek_v41"])
def checkpoint(request, tmp_path_factory):
    if request.param == "deepseek_v41":
        return FIXTURES / "tiny_b"
    directory, _ = build_engine_checkpoint(tmp_path_factory.mktemp("tiny_v4_graphs"), SMALL)
    return directory


def _generate(checkpoint, backend=None, **limits):
    llm = LLM(str(checkpoint), dtype="float32", **limits)
    if backend is not None:  # the same model in an engine on this backend, which captures its decode graphs
        llm = LLM.from_model(llm.engine.model, llm.tokenizer, backend=backend,
                             eos_token_ids=llm.engine.config.eos_token_ids, **limits)
    prompts = ragged_prompts(llm.engine.model.vocab_size, lengths=[3, 40, 17, 70, 9, 33, 64, 1])
    params = mixed_params(MAX_TOKENS)
    for i, p in enumerate(params):  # finishing at different steps: the batch bucket shrinks
        p.max_tokens, p.min_tokens = 2 + 2 * i, 0
    return llm.generate(prompts, params, use_tqdm=False), llm


def test_replayed_decode_steps_equal_eager_steps(checkpoint):
    eager, llm_eager = _generate(checkpoint, enforce_eager=True)
    assert llm_eager.engine.runner.decode_graphs is None
    backend = CapturingBackend()
    replayed, llm = _generate(checkpoint, backend=backend)
    graphs = llm.engine.runner.decode_graphs
    assert backend.captures == len(graphs._graphs) >= 3  # several batch buckets as sequences finish
    assert {rows for rows, _ in graphs._graphs} <= {1, 2, 4, 8, 16}
    for a, b in zip(eager, replayed, strict=True):
        assert_same_output(a, b)


class FailingCaptureBackend(Backend):
    """Capturing fails after the warm-up ran, as CUDA's does when an op synchronises with the host."""

    name = "failing-capture"

    @contextlib.contextmanager
    def graph_capture(self, device):
        def capture(fn):
            fn()
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

        yield capture


def test_a_failed_capture_falls_back_to_eager_steps(checkpoint, caplog):
    eager, _ = _generate(checkpoint, enforce_eager=True)
    with caplog.at_level("WARNING", logger="deepinfer.runner.decode_graphs"):
        replayed, llm = _generate(checkpoint, backend=FailingCaptureBackend())
    graphs = llm.engine.runner.decode_graphs
    assert graphs.eager_reason == "RuntimeError: operation not permitted when stream is capturing"
    assert sum("decode steps run eagerly" in r.message for r in caplog.records) == 1  # said once
    for a, b in zip(eager, replayed, strict=True):
        assert_same_output(a, b)


def test_bucket_choice():
    graphs = object.__new__(__import__("deepinfer.runner.decode_graphs", fromlist=["DecodeGraphs"]).DecodeGraphs)
    graphs.max_seqs, graphs.max_tokens = 48, 5000

    class S:
        def __init__(self, n):
            self.num_tokens = n

    assert graphs.buckets([S(0)]) == (1, 256)
    assert graphs.buckets([S(10), S(300), S(5)]) == (4, 512)
    assert graphs.buckets([S(1)] * 33) == (48, 256)  # capped at max_seqs
    assert graphs.buckets([S(4999)]) == (1, 5000)  # capped at max_model_len
    with pytest.raises(ValueError):
        graphs.buckets([])


def test_every_slot_and_page_comes_back_and_the_null_ones_are_never_handed_out(checkpoint):
    _, llm = _generate(checkpoint, enforce_eager=True)
    pool = llm.engine.model.pool
    assert len(llm.engine.state_cache) == 0
    assert llm.reset_prefix_cache()  # on by default: cached prompt blocks hold pages until dropped
    assert sorted(pool._free_slots) == list(range(1, pool.slots))  # every slot back, slot 0 never handed out
    for r, free in pool._free_pages.items():
        assert sorted(free) == list(range(1, pool.pages[r]))


def test_static_inputs_are_16_byte_aligned(checkpoint):
    """Batch bucket 1 packs one token id before the positions: every input must still start 16-byte aligned,
    since kernels are compiled ahead of time for aligned pointers (a misaligned one falls back to the JIT)."""
    from deepinfer import SamplingParams

    llm = LLM(str(checkpoint), dtype="float32")
    model, offsets = llm.engine.model, []
    decode_forward = model.decode_forward

    def spy(tensors):
        offsets.extend(t.data_ptr() % 16 for t in tensors.values())
        return decode_forward(tensors)

    model.decode_forward = spy
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(offsets) >= 4 and set(offsets) == {0}, offsets
