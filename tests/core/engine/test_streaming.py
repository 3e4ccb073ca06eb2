"""Incremental output (``output_kind``, ``LLM.generate_stream``), request metrics and ``LLM.chat``."""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer import LLM, RequestOutputKind, SamplingParams
from deepinfer.chat import FALLBACK_CHAT_TEMPLATE, ChatError, JinjaFormat, render_prompt
from tests.support.toy_model import ToyCausalLM, toy_tokenizer

PROMPTS = ["The quick brown fox jumps", "Once upon a time", "Le café", "She liked to read"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    tok = toy_tokenizer()
    return LLM.from_model(ToyCausalLM(len(tok), seed=3), tok, max_num_seqs=8)


def _params(kind: RequestOutputKind) -> list[SamplingParams]:
    """Greedy, seeded n=2 with logprobs, a stop string, min_tokens: every path of the output processor."""
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=kind),
        SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=10, logprobs=2, output_kind=kind),
        SamplingParams(temperature=1.0, seed=5, max_tokens=16, stop=["e ", "o"], output_kind=kind),
        SamplingParams(temperature=0.9, seed=6, max_tokens=9, min_tokens=3, output_kind=kind),
    ]


def test_delta_outputs_add_up_to_the_final_output(llm):
    ref = llm.generate(PROMPTS, _params(RequestOutputKind.CUMULATIVE), use_tqdm=False)
    tokens: dict[tuple[str, int], list[int]] = {}
    texts: dict[tuple[str, int], str] = {}
    logprobs: dict[tuple[str, int], list] = {}
    finished: dict[str, int] = {}
    streamed = list(llm.generate_stream(PROMPTS, _params(RequestOutputKind.DELTA)))
    assert len(streamed) > len(PROMPTS)  # outputs came per step, not once per request
    order = []
    for out in streamed:
        if out.request_id not in order:
            order.append(out.request_id)
        finished[out.request_id] = finished.get(out.request_id, 0) + out.finished
        for c in out.outputs:
            key = (out.request_id, c.index)
            tokens.setdefault(key, []).extend(c.token_ids)
            texts[key] = texts.get(key, "") + c.text
            logprobs.setdefault(key, []).extend(c.logprobs or [])
    assert all(v == 1 for v in finished.values())  # exactly one final output per request
    for rid, want in zip(order, ref, strict=True):
        for c in want.outputs:
            assert tokens[(rid, c.index)] == c.token_ids
            assert texts[(rid, c.index)] == c.text
            assert len(logprobs[(rid, c.index)]) == (len(c.token_ids) if c.logprobs is not None else 0)


def test_stop_string_text_is_held_back_until_it_cannot_be_cut(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=16, stop=["e ", "o"],
                            output_kind=RequestOutputKind.CUMULATIVE)
    outs = list(llm.generate_stream(PROMPTS, params))
    final = {o.request_id: o.outputs[0].text for o in outs if o.finished}
    for out in outs:
        for c in out.outputs:
            assert final[out.request_id].startswith(c.text)  # never text the final output does not have
            assert "o" not in c.text and "e " not in c.text


def test_final_only_and_cumulative(llm):
    finals = list(llm.generate_stream(PROMPTS, _params(RequestOutputKind.FINAL_ONLY)))
    assert len(finals) == len(PROMPTS) and all(o.finished for o in finals)
    cumulative = list(llm.generate_stream(PROMPTS, _params(RequestOutputKind.CUMULATIVE)))
    last: dict[tuple[str, int], list[int]] = {}
    for out in cumulative:
        for c in out.outputs:
            key = (out.request_id, c.index)
            assert c.token_ids[: len(last.get(key, []))] == last.get(key, [])  # grows, never rewrites
            last[key] = c.token_ids
    want = {(o.request_id, c.index): c.token_ids for o in finals for c in o.outputs}
    assert sorted(last.values()) == sorted(want.values())


def test_rejected_request_comes_first_and_early_close_empties_the_engine(llm):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    stream = llm.generate_stream(["Once upon a time", [10**6], "Le café"], params)
    first = next(stream)
    assert first.finished and first.error is not None and "vocabulary" in first.error
    next(stream)  # a running request's first tokens
    stream.close()
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.seqs and not engine.requests
    assert engine.state_cache.budget.used == 0
    assert llm.generate(["Le café"], SamplingParams(max_tokens=3), use_tqdm=False)[0].error is None


def test_request_metrics_are_ordered(llm):
    outs = llm.generate(PROMPTS, _params(RequestOutputKind.FINAL_ONLY), use_tqdm=False)
    for out in outs:
        m = out.metrics
        assert m is not None and m.first_scheduled_time is not None and m.first_token_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
        assert m.last_token_time <= m.finished_time
        assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
    bad = llm.generate([[10**6]], SamplingParams(), use_tqdm=False)[0]
    assert bad.metrics is not None and bad.metrics.first_token_time is None and bad.metrics.finished_time


def test_output_kind_is_validated():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")  # type: ignore[arg-type]
    assert dataclasses.replace(SamplingParams(), output_kind=RequestOutputKind.DELTA).output_kind.name == "DELTA"


def test_chat_renders_the_template_once_with_one_bos(llm):
    tok = llm.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "The quick "}, {"type": "text", "text": "brown fox"}]}]
    assert llm.chat_format.name == "fallback"  # the toy tokenizer has no template, the toy model no model_type
    prompt = render_prompt(tok, llm.chat_format, messages)
    assert prompt["prompt"] == "Be brief.\n\nUser: The quick brown fox\nAssistant:"  # the fallback template
    assert prompt["prompt_token_ids"] == tok.encode(prompt["prompt"])
    with_bos = render_prompt(tok, JinjaFormat(tok, "{{ bos_token }}" + FALLBACK_CHAT_TEMPLATE), messages)
    assert with_bos["prompt_token_ids"] == prompt["prompt_token_ids"]  # BOS from the template, not twice
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    plain = llm.generate(prompt["prompt"], params, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(llm.chat([messages, messages[1:]], params, use_tqdm=False)) == 2
    with pytest.raises(ChatError, match=r"messages\[1\]\.role"):
        llm.chat([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ChatError, match="text parts"):
        render_prompt(tok, llm.chat_format, [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_engine_abort_by_id_and_unique_ids(llm):
    engine = llm.engine
    with engine.lock:
        assert engine.add_request("Le café", SamplingParams(max_tokens=50), "x") is None
        dup = engine.add_request("Le café", SamplingParams(), "x")
        assert dup is not None and "already queued or running" in dup.error
        engine.step()
        assert engine.abort("x") and not engine.abort("x") and not engine.abort("nope")
        engine.drain()
        assert not engine.has_unfinished() and not engine.seqs and engine.state_cache.budget.used == 0
