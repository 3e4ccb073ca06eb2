"""V4.1's fixed-shape verify step (``verify_forward`` + ``commit_verify``, what ``runner/verify_graphs.py`` captures):
feeding a sequence's anchor and drafts in one step and keeping its first rows leaves exactly the state that feeding
those tokens one decode step at a time leaves, and its rows' outputs are those decode steps' outputs.  Through the
engine, greedy output with captured verify steps equals plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deepinfer
from deepinfer import LLM, SamplingParams
from deepinfer.kv.spec import SlotBuffer
from deepinfer.models import ForwardBatch, load_model
from deepinfer.ops import OpTable
from deepinfer.spec_decode.budget import SpecPolicy
from tests.support.engine_checks import assert_same_output
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)

ASSET = Path(deepinfer.__file__).parent / "assets" / "tiny_v41"


@pytest.fixture(scope="module")
def model():
    if not (ASSET / "config.json").exists():
        pytest.skip("no embedded tiny V4.1 in this tree")
    m = load_model(ASSET, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    m.configure_state(8, m.state_pool_bytes(8, 256))
    return m


def _feed(model, state, tokens: list[int]) -> torch.Tensor:
    """Logits of ``tokens`` fed to ``state`` (one ragged forward, or a decode step for one token)."""
    n = state.num_tokens
    hidden = model.forward(ForwardBatch(torch.tensor(tokens), torch.arange(n, n + len(tokens)), [len(tokens)],
                                        [state]))
    return model.compute_logits(hidden)


def _slot_buffers(model, state) -> dict[str, torch.Tensor]:
    pool = model.pool
    return {b.name: pool.tensors[b.name][state.slot].clone() for b in pool.spec.buffers if isinstance(b, SlotBuffer)}


@pytest.mark.parametrize("prompt_len,q,kept", [(37, 5, 1), (37, 5, 3), (38, 5, 5), (70, 4, 2), (70, 2, 2)])
def test_a_verify_step_keeps_what_decoding_the_kept_tokens_leaves(model, prompt_len, q, kept):
    gen = torch.Generator().manual_seed(prompt_len + 10 * q + kept)
    vocab = model.vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
    block = torch.randint(0, vocab, (q,), generator=gen).tolist()  # anchor + drafts
    with torch.no_grad():
        verified, plain, other = model.new_state(), model.new_state(), model.new_state()
        for s in (verified, plain, other):
            _feed(model, s, prompt)
        # another sequence in the same step, keeping all its rows
        inputs = model.verify_inputs([verified, other], [block[0], block[-1]], 4, q, 256)
        inputs["input_ids"].view(4, q)[0, 1:] = torch.tensor(block[1:])
        hidden, features, record = model.verify_forward(inputs)
        logits = model.compute_logits(hidden)
        model.commit_verify(record, [verified, other], torch.tensor([kept, q]), q, lambda t: t)([kept, q])
        decoded = torch.cat([_feed(model, plain, [t]) for t in block[:kept]])
    assert verified.num_tokens == plain.num_tokens == prompt_len + kept
    assert features.shape[0] == 4 * q
    torch.testing.assert_close(logits[:kept], decoded, rtol=1e-5, atol=1e-5)
    after_verified, after_plain = _slot_buffers(model, verified), _slot_buffers(model, plain)
    assert after_verified.keys() == after_plain.keys() and after_verified  # Engram history, compressor carry-over
    for name in after_plain:
        # (fp32 GEMMs of 4 * q rows against one: rounding apart)
        torch.testing.assert_close(after_verified[name], after_plain[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    with torch.no_grad():  # everything else the next steps read: their logits
        nxt = torch.randint(0, vocab, (q,), generator=gen).tolist()
        a = torch.cat([_feed(model, verified, [t]) for t in nxt])
        b = torch.cat([_feed(model, plain, [t]) for t in nxt])
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # a wrong row would be ~0.1 off
    for s in (verified, plain, other):
        s.release()


def test_commit_refuses_a_kept_count_out_of_range(model):
    state = model.new_state()
    with torch.no_grad():
        _feed(model, state, [1, 2, 3])
        _, _, record = model.verify_forward(model.verify_inputs([state], [4], 1, 3, 256))
    advance = model.commit_verify(record, [state], torch.tensor([3]), 3, lambda t: t)
    with pytest.raises(ValueError, match=r"kept\[0\] = 4: a verify step keeps 1 .. 3 rows"):
        advance([4])
    assert state.num_tokens == 3  # not advanced
    state.release()


@pytest.mark.parametrize("k,varlen", [(4, False), (2, False), (4, True)])
def test_greedy_output_with_captured_verify_steps_is_the_plain_output(k, varlen):
    if not (ASSET / "config.json").exists():
        pytest.skip("no embedded tiny V4.1 in this tree")
    llm = LLM(str(ASSET), dtype="float32", max_num_seqs=4)
    drafter = llm.engine.drafter or llm.engine.model.make_drafter()
    prompts = ["Once upon a time", "One day, a boy", "The cat sat"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True, repetition_penalty=1.3)]
    llm.engine.set_drafter(None)
    plain = llm.generate(prompts, [params[0], params[1], params[0]], use_tqdm=False)
    llm.engine.set_drafter(drafter, SpecPolicy(k, varlen))
    spec = llm.generate(prompts, [params[0], params[1], params[0]], use_tqdm=False)
    graphs = llm.engine.runner.verify_graphs
    assert graphs is not None and graphs._graphs  # the pure-decode steps ran as verify steps
    assert graphs.extender is drafter  # ... which extended the drafter's context, rejected rows included
    for a, b in zip(plain, spec, strict=True):
        assert_same_output(a, b, tol=2e-2)
        assert b.spec_decoding_stats.mean_acceptance_length > 1.5
    # the drafter's context extended eagerly with the kept rows alone drafts the same (equal acceptance)
    graphs.extender = None
    graphs._graphs.clear()
    eager = llm.generate(prompts, [params[0], params[1], params[0]], use_tqdm=False)
    for a, b in zip(eager, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.spec_decoding_stats.num_accepted_tokens_per_pos == b.spec_decoding_stats.num_accepted_tokens_per_pos
