"""Speculative decoding through LLM.generate with a stand-in drafter (tests/support/stand_in_drafter.py).

Greedy output equals decoding without speculation whatever the drafter proposes (random, perfect and mixed
drafts), on V4 and both V4.1 fixtures, with every draft verified and with confidence-scheduled verification,
for several draft lengths; penalties, stop strings, min_tokens, max_tokens, logprobs and n > 1 included.  The
sampled distribution equals plain sampling's (a two-sample chi-square); seeded runs repeat; grammars constrain
drafts; the drafter's context and the model state after speculative steps equal plain ones.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import deepinfer
from deepinfer import LLM, SamplingParams
from deepinfer.models.deepseek_v4.state import layer_view
from deepinfer.spec_decode.budget import CostTable, SpecPolicy
from tests.support.engine_checks import assert_same_output, homogeneity_p, ragged_prompts
from tests.support.stand_in_drafter import StandInDrafter
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)
from tests.support.v41_fixtures import FIXTURES

MODELS = {"v4": Path(deepinfer.__file__).parent / "assets" / "tiny_v4", "v41_a": FIXTURES / "tiny_a",
          "v41_b": FIXTURES / "tiny_b"}
#: A cost that grows with the tokens a step verifies, so confidence-scheduled verification cuts drafts.
STEEP = CostTable(tuple(range(1, 257)), tuple(1.0 + 0.08 * n for n in range(1, 257)))


#: Logprob tolerance of each model between a speculative and a plain run: V4.1's FP8 fake-quantized KV turns
#: rounding differences of a chunk forward into logprob differences of ~5e-3 (the same between a request run
#: alone and batched without speculation) ...
TOL = {"v4": 1e-4, "v41_a": 2e-2, "v41_b": 2e-2}
#: ... and, rarely, a value across an FP8 rounding boundary: the positions after it differ by a few hundredths
#: (tiny_a on one CPU: 0.033 and 0.088 at two positions of 103; medians 1e-6).  Tokens must still be equal.
FLIPS = {"v4": None, "v41_a": (0.15, 3), "v41_b": (0.15, 3)}


@pytest.fixture(scope="module", params=list(MODELS))
def llm(request):
    llm = LLM(str(MODELS[request.param]), dtype="float32")
    llm.test_tol, llm.test_flips = TOL[request.param], FLIPS[request.param]
    return llm


def _generate(llm, prompts, params, drafter=None, policy=None):
    llm.engine.set_drafter(drafter, policy)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.set_drafter(None)


def _greedy_params(max_tokens: int) -> list[SamplingParams]:
    kinds = [
        dict(),
        dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.3),
        dict(stop=["e"], ignore_eos=False),
        dict(min_tokens=5, ignore_eos=False),
        dict(max_tokens=1),
        dict(max_tokens=3),
        dict(n=2),
    ]
    base = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    return [SamplingParams(**{**base, **k}) for k in kinds]


@pytest.mark.parametrize("mode", ["random", "oracle", "mixed"])
@pytest.mark.parametrize("k,varlen", [(1, False), (4, False), (3, True)])
def test_greedy_output_is_the_plain_output(llm, mode, k, varlen):
    vocab = llm.engine.model.vocab_size
    prompts = ragged_prompts(vocab, lengths=[9, 14, 21, 5, 30, 11, 17])
    params = _greedy_params(18)
    plain = _generate(llm, prompts, params)
    oracle = [p + c.token_ids for p, o in zip(prompts, plain, strict=True) for c in o.outputs]
    drafter = StandInDrafter(vocab, 4, mode, oracle)
    spec = _generate(llm, prompts, params, drafter, SpecPolicy(k, varlen, STEEP if varlen else None))
    for a, b in zip(plain, spec, strict=True):
        assert_same_output(a, b, tol=llm.test_tol, flips=llm.test_flips)
    assert drafter.calls > 0
    stats = [o.spec_decoding_stats for o in spec if o.spec_decoding_stats is not None]
    assert stats and all(s.num_draft_tokens <= k * s.num_drafts for s in stats)
    if mode == "oracle" and not varlen:  # perfect drafts: (nearly) everything is accepted
        total = sum(s.num_accepted_tokens for s in stats) / sum(s.num_draft_tokens for s in stats)
        assert total > 0.9
    if mode == "random":
        assert max(s.mean_acceptance_length for s in stats) < 1.5


def test_confidence_scheduling_verifies_fewer_drafts(llm):
    vocab = llm.engine.model.vocab_size
    prompts = ragged_prompts(vocab, lengths=[9, 14, 21, 5])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    drafted = {}
    for varlen in (False, True):
        out = _generate(llm, prompts, params, StandInDrafter(vocab, 4), SpecPolicy(4, varlen, STEEP))
        drafted[varlen] = sum(o.spec_decoding_stats.num_draft_tokens for o in out)
        drafted[varlen] /= sum(o.spec_decoding_stats.num_drafts for o in out)
    assert drafted[False] == pytest.approx(4.0, abs=0.25)  # (fewer only near max_tokens)
    assert 1.0 <= drafted[True] < drafted[False] - 0.5


#: The embedded tiny V4.1 ships a drafter, so its state keeps spare ring rows and its pure-decode speculative steps
#: run as verify steps (runner/verify_graphs.py); the other fixtures verify through the ragged forward.
TINY_V41 = Path(deepinfer.__file__).parent / "assets" / "tiny_v41"


@pytest.mark.parametrize("mode,model,varlen", [  # 4-9 s each: the default run keeps one case a model and a policy
    ("random", MODELS["v4"], False), pytest.param("mixed", MODELS["v4"], False, marks=pytest.mark.slow),
    pytest.param("mixed", TINY_V41, False, marks=pytest.mark.slow), ("mixed", TINY_V41, True)])
def test_sampled_tokens_have_the_plain_distribution(mode, model, varlen):
    llm = LLM(str(model), dtype="float32")
    llm.engine.set_drafter(None)
    vocab = llm.engine.model.vocab_size
    prompt = ragged_prompts(vocab, lengths=[12])[0]
    n = 400
    params = [SamplingParams(temperature=1.3, top_k=3, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)]
    plain = _generate(llm, [prompt] * n, params)
    oracle = [prompt + o.outputs[0].token_ids for o in plain]  # plausible drafts: other seeds' samples
    drafter = StandInDrafter(vocab, 3, mode, oracle)
    spec = _generate(llm, [prompt] * n, params, drafter, SpecPolicy(3, varlen, STEEP if varlen else None))
    if mode == "mixed" and not varlen:  # drafts often accepted: acceptance and the penalties of later rows matter
        accepted = sum(o.spec_decoding_stats.num_accepted_tokens for o in spec)
        assert accepted > n / 2

    def counts(outs, positions):
        keys = [tuple(o.outputs[0].token_ids[p] for p in positions) for o in outs]
        cells = sorted(set(keys) | set(tuple(c) for c in cells_all))
        return torch.tensor([keys.count(c) for c in cells], dtype=torch.float64)

    for positions in ([1], [2], [1, 2], [3]):
        cells_all = {tuple(o.outputs[0].token_ids[p] for p in positions) for o in plain + spec}
        p = homogeneity_p(counts(plain, positions), counts(spec, positions))
        assert p > 1e-3, (positions, p)
    _check_verify_steps(llm, model)
    # Negative control: the sampled tokens do vary (the trained tiny V4.1 is peaky: 15 distinct of 400).
    assert len({tuple(o.outputs[0].token_ids) for o in spec}) > 10


def test_seeded_sampling_with_drafts_repeats_and_is_the_plain_output(llm):
    """Random drafts (of the drafter's own generator, so other drafts in each run): the same seeded output every
    run, and it is plain sampling's output."""
    vocab = llm.engine.model.vocab_size
    prompts = ragged_prompts(vocab, lengths=[9, 14, 21])
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, ignore_eos=True, seed=s, logprobs=1)
              for s in (1, 2, 3)]
    runs = [_generate(llm, prompts, params, StandInDrafter(vocab, 4, seed=5 + i), SpecPolicy(4)) for i in range(2)]
    for a, b, c in zip(*runs, _generate(llm, prompts, params), strict=True):
        assert_same_output(a, b, tol=llm.test_tol, flips=llm.test_flips)
        assert_same_output(c, a, tol=llm.test_tol, flips=llm.test_flips)


@pytest.mark.parametrize("model", [MODELS["v4"], TINY_V41])
def test_structured_output_constrains_and_rolls_back_drafts(model):
    llm = LLM(str(model), dtype="float32")
    vocab = llm.engine.model.vocab_size
    pattern = r"[a-z]{2,6} [0-9]{1,3}"
    prompts = ["Once upon a time", "The answer is"]
    params = [SamplingParams(temperature=0, max_tokens=30, so_args={"regex": pattern}, min_tokens=3),
              SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=30, so_args={"regex": pattern})]
    plain = _generate(llm, prompts, params)
    tok = llm.get_tokenizer()
    oracle = [tok(p)["input_ids"] + c.token_ids for p, o in zip(prompts, plain, strict=True) for c in o.outputs]
    for mode in ("random", "oracle"):
        spec = _generate(llm, prompts, params, StandInDrafter(vocab, 4, mode, oracle), SpecPolicy(4))
        assert_same_output(plain[0], spec[0], tol=1e-4)
        for out in spec:
            for comp in out.outputs:
                assert re.fullmatch(pattern, comp.text), comp.text
                assert comp.finish_reason == "stop"
        if mode == "oracle":
            assert spec[0].spec_decoding_stats.num_accepted_tokens > 0
    _check_verify_steps(llm, model)


def _check_verify_steps(llm, model) -> None:
    """The embedded tiny V4.1's pure-decode speculative steps ran as verify steps."""
    graphs = llm.engine.runner.verify_graphs
    assert (model == TINY_V41) == bool(graphs is not None and graphs._graphs)


def test_state_and_drafter_context_after_speculative_steps_equal_plain_steps():
    """Step the engine by hand: after each speculative step the sequence's state (rings, entries, carry-over,
    indexer keys) equals a state fed the same tokens plainly, and the drafter holds every accepted position."""
    llm = LLM(str(MODELS["v4"]), dtype="float32")
    engine, model = llm.engine, llm.engine.model
    vocab = model.vocab_size
    prompt = ragged_prompts(vocab, lengths=[29])[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    oracle = prompt + llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    drafter = StandInDrafter(vocab, 4, "mixed", [oracle], wrong_every=3)
    engine.set_drafter(drafter, SpecPolicy(4))
    engine.add_request(prompt, params)
    rejected, longest = 0, 0
    schedule = engine.schedule

    def spy():
        nonlocal longest
        out = schedule()
        longest = max([longest] + [len(c.token_ids) for c in out.chunks if c.start > 0])
        return out

    engine.schedule = spy
    while engine.has_unfinished():
        engine.step()
        for seq in engine.seqs.values():
            state = engine.state_cache.get(seq.seq_id)
            assert state.num_tokens == seq.num_computed
            assert drafter.context[state] == list(range(len(seq.token_ids) - 1))
            rejected += seq.num_computed < len(seq.token_ids) - 1
            fresh = model.new_state()
            ids = seq.token_ids[: state.num_tokens]
            with torch.no_grad():
                from deepinfer.models import ForwardBatch

                model.forward(ForwardBatch(torch.tensor(ids), torch.arange(len(ids)), [len(ids)], [fresh]))
            window, ring = model.pool.spec.window, model.pool.spec.ring
            held = torch.tensor([p % ring for p in range(max(0, len(ids) - window), len(ids))])
            for layer in range(len(model.pool.views)):
                a, b = layer_view(state, layer), layer_view(fresh, layer)
                # (ring rows of positions not fed yet hold whatever the slot held before: never read)
                for x, y in zip((a.swa_ring[held], a.entries, a.pending_kv, a.index_keys),
                                (b.swa_ring[held], b.entries, b.pending_kv, b.index_keys), strict=True):
                    assert (x is None) == (y is None)
                    if x is not None:
                        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
            fresh.release()
    engine.set_drafter(None)
    assert rejected > 0  # rollbacks happened
    assert 2 < longest <= 4 + 2  # accepted tokens were fed again, never more than anchor + drafts + 1


def test_greedy_identity_under_v41_decoder_prefill_truncation(monkeypatch):
    """DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact: verify chunks and re-feeds stay within KEEP of the anchor,
    so speculative decoding after a truncated prefill equals plain decoding after it."""
    from tests.support.v41_fixtures import references

    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "40")  # tiny_b: window 24
    llm = LLM(str(MODELS["v41_b"]), dtype="float32", max_num_batched_tokens=50)
    prompts = [references("tiny_b")[0].tokens[:120].tolist(), references("tiny_b")[0].tokens[:77].tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    plain = _generate(llm, prompts, params)
    oracle = [p + o.outputs[0].token_ids for p, o in zip(prompts, plain, strict=True)]
    spec = _generate(llm, prompts, params, StandInDrafter(llm.engine.model.vocab_size, 4, "mixed", oracle),
                     SpecPolicy(4))
    for a, b in zip(plain, spec, strict=True):
        assert_same_output(a, b, tol=TOL["v41_b"], flips=FLIPS["v41_b"])
        assert b.spec_decoding_stats.num_accepted_tokens > 0
