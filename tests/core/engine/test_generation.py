"""Generation features on the toy model: stops, lengths, n > 1, logprobs, penalties, seeded sampling."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.engine import fork_seed
from tests.support.engine_checks import chi_square_p
from tests.support.toy_model import ToyCausalLM, toy_tokenizer

PROMPT = "Once upon a time there was"


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return ToyCausalLM(len(tokenizer), seed=3)


@pytest.fixture(scope="module")
def llm(model, tokenizer):
    return LLM.from_model(model, tokenizer)


def _one(llm, prompt=PROMPT, **kwargs):
    return llm.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def free_run(llm):
    """Greedy, 40 tokens, no stop conditions: the reference the stop tests cut."""
    return _one(llm, temperature=0, max_tokens=40, ignore_eos=True)


def test_max_tokens_and_max_model_len_finish_with_length(llm, model, tokenizer, free_run):
    assert len(free_run.token_ids) == 40 and free_run.finish_reason == "length" and free_run.stop_reason is None
    short = LLM.from_model(model, tokenizer, max_model_len=len(tokenizer.encode(PROMPT)) + 5)
    out = _one(short, temperature=0, max_tokens=40, ignore_eos=True)
    assert out.token_ids == free_run.token_ids[:5] and out.finish_reason == "length"


def test_text_is_the_incremental_decode(free_run, tokenizer):
    assert free_run.text == tokenizer.decode(free_run.token_ids, skip_special_tokens=True)


def _stop_string(text: str) -> str:
    """A 2-character substring from the second half of ``text`` that is clean text."""
    for i in range(len(text) // 2, len(text) - 2):
        s = text[i : i + 2]
        if "\ufffd" not in s:
            return s
    pytest.skip("toy text has no clean substring")


def test_stop_string_cuts_text(llm, free_run):
    stop = _stop_string(free_run.text)
    out = _one(llm, temperature=0, max_tokens=40, ignore_eos=True, stop=["@@never@@", stop])
    idx = free_run.text.find(stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free_run.text[:idx]
    assert out.token_ids == free_run.token_ids[: len(out.token_ids)] and len(out.token_ids) < 40
    kept = _one(llm, temperature=0, max_tokens=40, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert kept.text == free_run.text[: idx + len(stop)]


def test_stop_token_ids_and_eos(llm, model, tokenizer, free_run):
    stop = free_run.token_ids[6]
    first = free_run.token_ids.index(stop)
    out = _one(llm, temperature=0, max_tokens=40, stop_token_ids=[stop], ignore_eos=True)
    assert out.token_ids == free_run.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop

    eos_llm = LLM.from_model(model, tokenizer, eos_token_ids=[stop])  # stands in for the tokenizer's EOS
    out = _one(eos_llm, temperature=0, max_tokens=40)
    assert out.token_ids == free_run.token_ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason is None
    ignored = _one(eos_llm, temperature=0, max_tokens=40, ignore_eos=True)
    assert ignored.token_ids == free_run.token_ids and ignored.finish_reason == "length"

    # The tokenizer's own EOS is the default stop (the toy model happens to emit it).
    eos = tokenizer.eos_token_id
    assert eos in free_run.token_ids
    out = _one(llm, temperature=0, max_tokens=40)
    assert out.token_ids == free_run.token_ids[: free_run.token_ids.index(eos) + 1] and out.finish_reason == "stop"


def test_min_tokens_holds_back_stops(llm, free_run):
    stop = free_run.token_ids[1]
    min_tokens = 8
    out = _one(llm, temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop], min_tokens=min_tokens)
    assert len(out.token_ids) >= min_tokens
    assert stop not in out.token_ids[:min_tokens]  # banned while below min_tokens
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop and stop not in out.token_ids[min_tokens:-1]


def test_n_completions_share_the_prompt(llm, model, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    calls = len(model.forward_calls)
    out = llm.generate(PROMPT, SamplingParams(n=3, seed=99, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert model.forward_calls[calls] == [len(prompt_ids)]  # one prefill, not three
    assert sum(sum(c) for c in model.forward_calls[calls:]) == len(prompt_ids) + 3 * 5
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Completion i is what a single request seeded with fork_seed(seed, i) draws.
    for comp in out.outputs:
        alone = _one(llm, seed=fork_seed(99, comp.index), max_tokens=6, ignore_eos=True)
        assert alone.token_ids == comp.token_ids


def test_logprobs_shape(llm):
    out = _one(llm, temperature=0.8, seed=5, max_tokens=5, logprobs=3, ignore_eos=True)
    assert len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in entry and len(entry) in (3, 4)
        top = sorted((lp for t, lp in entry.items() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top][:3] == [1, 2, 3] and top[0].logprob >= top[-1].logprob
        assert all(lp.logprob <= 0 and isinstance(lp.decoded_token, str) for lp in entry.values())
    chosen = zip(out.token_ids, out.logprobs, strict=True)
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in chosen))
    assert _one(llm, max_tokens=2).logprobs is None


def test_penalised_greedy_equals_oracle(llm, model, tokenizer):
    """Each greedy token is the argmax of the penalised full-forward logits (penalties written out here)."""
    params = dict(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.5)
    out = _one(llm, temperature=0, max_tokens=12, ignore_eos=True, **params)
    prompt = tokenizer.encode(PROMPT)
    seq = list(prompt)
    for tok in out.token_ids:
        logits = model.full_logits(seq)[-1].clone()
        output = seq[len(prompt):]
        for t in set(seq):
            logits[t] = logits[t] / 1.5 if logits[t] > 0 else logits[t] * 1.5
        for t in set(output):
            logits[t] -= 0.3 * output.count(t) + 0.7
        assert tok == int(logits.argmax())
        seq.append(tok)
    plain = _one(llm, temperature=0, max_tokens=12, ignore_eos=True)
    assert plain.token_ids != out.token_ids  # the penalties changed something


def test_seeded_sampling_is_reproducible(model, tokenizer):
    a = LLM.from_model(model, tokenizer, seed=1)
    b = LLM.from_model(model, tokenizer, seed=2)
    seeded = dict(temperature=1.0, top_p=0.95, max_tokens=10, ignore_eos=True)
    assert _one(a, seed=42, **seeded).token_ids == _one(b, seed=42, **seeded).token_ids
    assert _one(a, seed=42, **seeded).token_ids != _one(a, seed=43, **seeded).token_ids
    # Unseeded requests draw their seeds from LLM(seed=...): same engine seed, same tokens.
    c = LLM.from_model(model, tokenizer, seed=1)
    assert _one(a, **seeded).token_ids == _one(c, **seeded).token_ids
    d = LLM.from_model(model, tokenizer, seed=1)
    _one(d, **seeded)  # consumes one request seed
    assert _one(d, **seeded).token_ids != _one(LLM.from_model(model, tokenizer, seed=1), **seeded).token_ids


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 5)])
def test_first_token_follows_model_distribution(temperature, top_k):
    """n forked samples of one prompt are draws from softmax(logits / T) (truncated to top-k)."""
    vocab, n = 12, 3000
    model = ToyCausalLM(vocab, hidden=16, seed=4, logit_scale=2.0)
    llm = LLM.from_model(model, None, max_num_seqs=n)
    prompt = [1, 5, 7, 2]
    params = SamplingParams(n=n, temperature=temperature, top_k=top_k, seed=2024, max_tokens=1, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out.outputs]), minlength=vocab).double()
    logits = model.full_logits(prompt)[-1].double() / temperature
    if top_k:
        logits[logits < logits.topk(top_k).values[-1]] = float("-inf")
    probs = torch.softmax(logits, -1)
    support = probs > 0
    assert counts[~support].sum() == 0
    assert chi_square_p(counts[support], probs[support]) > 1e-3


def test_structured_output_mixes_with_free_requests(llm, tokenizer):
    """so_args constrains its request (and each of its n completions); free neighbours are unaffected."""
    import re

    pattern = r"[a-z]{2,6} [0-9]{1,3}"
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, seed=8, n=2, max_tokens=30, so_args={"regex": pattern})
    greedy_constrained = SamplingParams(temperature=0, max_tokens=30, so_args={"regex": pattern}, min_tokens=3)
    outs = llm.generate([PROMPT, PROMPT, PROMPT], [free, constrained, greedy_constrained], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == _one(llm, temperature=0, max_tokens=10, ignore_eos=True).token_ids
    for out in outs[1:]:
        for comp in out.outputs:
            assert re.fullmatch(pattern, comp.text), comp.text
            assert comp.finish_reason == "stop" and comp.token_ids[-1] == tokenizer.eos_token_id
