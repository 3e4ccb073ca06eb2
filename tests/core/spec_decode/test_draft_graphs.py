"""Draft passes replayed from captured graphs (``runner/draft_graphs.py``), greedy and sampled, give the eager drafts
(bit for bit with a batch-invariant op table, or where no padding row is added).

The embedded tiny V4.1 and its trained DSpark drafter, on the CPU, with a batch-invariant op table
(``DEEPINFER_BATCH_INVARIANT=1``: padding rows cannot change a real row's rounding) and with the default one.
``CapturingBackend`` behaves like CUDA graphs (capture runs the pass twice on whatever the static buffer holds,
then replays re-run it on the buffer's current contents).  Batches of 1, 2, 3, 5 and 6 requests cross the
1/2/4/8-row buckets, so padding rows (the null slot at position 0) run next to real ones.  Through the engine,
greedy speculative output with captured drafts equals plain decoding, and sampled output with captured sampled
drafts has plain sampling's distribution and repeats for equal seeds.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.backends import Backend
from deepinfer.runner.draft_graphs import DraftGraphs
from deepinfer.spec_decode.budget import SpecPolicy
from deepinfer.spec_decode.drafter import DraftRequest, GraphDrafter
from tests.support.engine_checks import assert_same_output, homogeneity_p
from tests.support.tiny_assets import TINY_V41_DIR
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)
from tools.train.dspark_accept import slot_state


class CapturingBackend(Backend):
    name = "capturing"

    def __init__(self, fail: bool = False) -> None:
        self.captures, self.fail = 0, fail

    @contextlib.contextmanager
    def graph_capture(self, device):
        def capture(fn):
            if self.fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            fn()  # warm-up
            fn()  # "capture"
            self.captures += 1
            return fn

        yield capture


def _load(batch_invariant: bool) -> LLM:
    if not (TINY_V41_DIR / "config.json").exists():
        pytest.skip("no embedded tiny V4.1 in this tree")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_BATCH_INVARIANT", "1" if batch_invariant else "0")
        return LLM(str(TINY_V41_DIR), dtype="float32", max_num_seqs=8)


def _with_contexts(llm: LLM):
    """The checkpoint's drafter with contexts in slots 1, 2, 4, 5, 6 (random target features; slot 3 empty)."""
    drafter = llm.engine.drafter or llm.engine.model.make_drafter()
    gen = torch.Generator().manual_seed(0)
    width = len(drafter.capture_layer_ids) * llm.engine.model.config.hidden_size
    for slot, length in [(1, 40), (2, 7), (4, 200), (5, 13), (6, 64)]:
        drafter.extend([slot_state(slot)] * length, torch.arange(length), torch.randn(length, width, generator=gen))
    return drafter


@pytest.fixture(scope="module")
def llm():
    return _load(False)


@pytest.fixture(scope="module", params=[True, False], ids=["batch-invariant", "default-ops"])
def table(request, llm):
    """(the drafter with contexts, whether its op table is batch invariant)."""
    drafter = _with_contexts(_load(True) if request.param else llm)
    yield drafter, request.param
    for slot in range(1, 7):
        drafter.free(slot_state(slot))


@pytest.fixture
def drafter(table):
    return table[0]


def _requests(n: int) -> list[DraftRequest]:
    at = [(1, 17, 40), (2, 301, 7), (3, 5, 0), (4, 88, 200), (5, 120, 9), (6, 42, 64)]  # slot, anchor, position
    return [DraftRequest(slot_state(slot), anchor, position, 0.0, 0, 0) for slot, anchor, position in at[:n]]


@pytest.mark.parametrize("fail", [False, True], ids=["captured", "capture-fails"])
def test_captured_drafts_equal_eager_drafts(table, fail):
    """Bit for bit with a batch-invariant op table; with the default table too where no padding row is added
    (the same rows run the same code), and up to a GEMM's rounding otherwise (the tokens still equal)."""
    drafter, invariant = table
    assert isinstance(drafter, GraphDrafter)
    backend = CapturingBackend(fail)
    graphs = DraftGraphs(drafter, backend, torch.device("cpu"), max_seqs=8)
    k_max = drafter.max_draft_len
    for k in (k_max, 2):
        for n in (1, 3, 2, 5, 6, 3):  # buckets 1, 4, 2, 8, 8, 4: each captured once, then replayed
            requests = _requests(n)
            eager = drafter.draft(requests, k)
            captured = graphs.run(requests, k)
            assert torch.equal(captured.tokens, eager.tokens), (k, n)
            if invariant or n in (1, 2):
                assert torch.equal(captured.confidence, eager.confidence), (k, n)
            else:
                torch.testing.assert_close(captured.confidence, eager.confidence, atol=1e-5, rtol=0)
    assert sorted(graphs._graphs) == sorted((b, k, False) for k in (2, k_max) for b in (1, 2, 4, 8))
    assert backend.captures == (0 if fail else 8)
    assert (graphs.eager_reason is not None) == fail
    graphs.close()


def test_padding_reads_no_context(drafter):
    """A padding row (all zeros: slot 0 at position 0) has no valid context row, whatever slot 0 holds."""
    _, valid = drafter.context.window_of(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    assert not valid.any()
    inputs = drafter.draft_inputs(_requests(3), 4)
    assert inputs.tolist()[3] == [0] * 6 and inputs.dtype == torch.int64  # temperature 0.0: greedy
    with pytest.raises(ValueError, match="do not fit"):
        drafter.draft_inputs(_requests(3), 2)


def _mixed_requests(n: int, seed: int = 0) -> list[DraftRequest]:
    """``_requests(n)``, every other one sampled (temperatures 0.7 and 1.3, seeds of ``seed``)."""
    temps = [0.7, 0.0, 1.3, 0.0, 0.7, 1.3]
    return [DraftRequest(r.state, r.anchor, r.position, temps[i], seed + 31 * i, 3 * i)
            for i, r in enumerate(_requests(n))]


@pytest.mark.parametrize("fail", [False, True], ids=["captured", "capture-fails"])
def test_captured_sampled_drafts_equal_eager_sampled_drafts(table, fail):
    """A step with a sampled request replays the sampled pass of its (bucket, k): tokens and confidence as the
    eager draft (bit for bit with a batch-invariant op table or without padding rows; else the confidence up to a
    GEMM's rounding and the same tokens).  Greedy rows in the batch stay argmax; other seeds draw other drafts."""
    drafter, invariant = table
    backend = CapturingBackend(fail)
    graphs = DraftGraphs(drafter, backend, torch.device("cpu"), max_seqs=8)
    k_max = drafter.max_draft_len
    for k in (k_max, 2):
        for n, seed in [(1, 0), (3, 0), (2, 5), (5, 0), (6, 9), (3, 9)]:
            requests = _mixed_requests(n, seed)
            eager = drafter.draft(requests, k)
            captured = graphs.run(requests, k)
            assert captured.tokens.shape == (n, k)
            assert torch.equal(captured.tokens, eager.tokens), (k, n)
            if invariant or n in (1, 2):
                assert torch.equal(captured.confidence, eager.confidence), (k, n)
            else:
                torch.testing.assert_close(captured.confidence, eager.confidence, atol=1e-5, rtol=0)
        greedy_only = graphs.run(_requests(3), k)  # the greedy pass of the same bucket: its own graph
        assert torch.equal(greedy_only.tokens, drafter.draft(_requests(3), k).tokens)
    assert {key for key in graphs._graphs if key[2]} == {(b, k, True) for k in (2, k_max) for b in (1, 2, 4, 8)}
    assert {key for key in graphs._graphs if not key[2]} == {(4, 2, False), (4, k_max, False)}
    assert backend.captures == (0 if fail else 10)
    others = [graphs.run(_mixed_requests(1, seed), k_max).tokens.clone() for seed in range(1, 9)]
    assert any(not torch.equal(t, others[0]) for t in others)  # the draws follow the seed
    graphs.close()


def test_engine_greedy_output_with_captured_drafts_is_the_plain_output(llm):
    """Speculation with the captured draft path on (the CPU engine has decode graphs): greedy output equals plain
    decoding for batches of 1, 3 and 5 completions (buckets 1, 4, 8 as sequences finish); drafts were replayed."""
    engine = llm.engine
    drafter = engine.drafter or engine.model.make_drafter()
    engine.set_drafter(None)
    prompts = ["Once upon a time", "One day, a boy", "The cat", "A little girl named Lily"]
    batches = [(prompts[:1], [8]), (prompts[:3], [12, 5, 9]), (prompts, [10, 3, 14, 6, 7])]
    for batch, lengths in batches:
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=1) for m in lengths]
        if len(lengths) > len(batch):  # one prompt with n = 2 (a fork shares its prefill and draft context)
            params = params[: len(batch) - 1] + [SamplingParams(temperature=0.0, max_tokens=lengths[-1],
                                                                ignore_eos=True, logprobs=1, n=2)]
        engine.set_drafter(None)
        plain = llm.generate(batch, params, use_tqdm=False)
        engine.set_drafter(drafter, SpecPolicy(min(4, drafter.max_draft_len)))
        assert engine.runner.draft_graphs is not None and engine.runner.draft_graphs.drafter is drafter
        try:
            spec = llm.generate(batch, params, use_tqdm=False)
        finally:
            engine.set_drafter(None)
        for a, b in zip(plain, spec, strict=True):
            assert_same_output(a, b, tol=2e-2)
            assert b.spec_decoding_stats is not None and b.spec_decoding_stats.num_drafts > 0
    graphs = engine.runner.draft_graphs  # kept while speculation is off
    assert graphs is not None and graphs.eager_reason is None
    assert {rows for rows, _, _ in graphs._graphs} >= {1, 4}


def test_engine_sampled_output_with_captured_drafts_has_the_plain_distribution(llm):
    """Sampled requests draft through the captured sampled passes (no eager fallback): the output tokens have plain
    sampling's distribution (a two-sample chi-square over 300 seeds, as tests/core/spec_decode/test_spec_engine.py does
    with a stand-in drafter), and a seeded batch run twice gives the same tokens."""
    engine = llm.engine
    drafter = engine.drafter or engine.model.make_drafter()
    prompt, n = "Once upon a time", 300
    params = [SamplingParams(temperature=1.3, top_k=3, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)]
    engine.set_drafter(None)
    plain = llm.generate([prompt] * n, params, use_tqdm=False)
    engine.set_drafter(drafter, SpecPolicy(min(3, drafter.max_draft_len)))
    mixed = [SamplingParams(temperature=t, max_tokens=12, ignore_eos=True, seed=s, logprobs=1)
             for s, t in [(1, 1.0), (2, 0.0), (3, 0.7)]]
    prompts = ["Once upon a time", "One day, a boy", "The cat"]
    try:
        spec = llm.generate([prompt] * n, params, use_tqdm=False)
        runs = [llm.generate(prompts, mixed, use_tqdm=False) for _ in range(2)]
    finally:
        engine.set_drafter(None)
    assert sum(o.spec_decoding_stats.num_drafts for o in spec) > 0

    def counts(outs, positions, cells):
        keys = [tuple(o.outputs[0].token_ids[p] for p in positions) for o in outs]
        return torch.tensor([keys.count(c) for c in cells], dtype=torch.float64)

    for positions in ([1], [2], [1, 2], [3]):
        cells = sorted({tuple(o.outputs[0].token_ids[p] for p in positions) for o in plain + spec})
        p = homogeneity_p(counts(plain, positions, cells), counts(spec, positions, cells))
        assert p > 1e-3, (positions, p)
    assert len({tuple(o.outputs[0].token_ids) for o in spec}) > 10  # negative control: the samples vary
    for a, b in zip(*runs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.spec_decoding_stats is not None and b.spec_decoding_stats.num_drafts > 0
    graphs = engine.runner.draft_graphs  # kept while speculation is off
    assert graphs is not None and graphs.eager_reason is None
    assert any(sampled for _, _, sampled in graphs._graphs)  # the sampled passes were captured and replayed


def test_enforce_eager_drafts_eagerly():
    if not (TINY_V41_DIR / "config.json").exists():
        pytest.skip("no embedded tiny V4.1 in this tree")
    llm = LLM(str(TINY_V41_DIR), dtype="float32", enforce_eager=True, max_num_seqs=2)
    drafter = llm.engine.drafter or llm.engine.model.make_drafter()
    llm.engine.set_drafter(drafter, SpecPolicy(2))
    assert llm.engine.runner.draft_graphs is None
