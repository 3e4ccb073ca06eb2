"""A thread that calls the LLM inside its own open generate_stream() gets an error at once, not a hang; another
thread waits for the stream and then runs."""

from __future__ import annotations

import threading

import pytest

from deepinfer import LLM, SamplingParams
from tests.support.toy_model import ToyCausalLM, toy_tokenizer

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    tok = toy_tokenizer()
    return LLM.from_model(ToyCausalLM(len(tok), seed=3), tok, max_num_seqs=4)


@pytest.mark.parametrize("call", ["generate", "chat", "generate_stream"])
def test_same_thread_reentry_raises_at_once(llm, call):
    stream = llm.generate_stream(["hello"], PARAMS)
    next(stream)  # the stream now holds the engine, suspended
    again = {
        "generate": lambda: llm.generate(["again"], PARAMS, use_tqdm=False),
        "chat": lambda: llm.chat([{"role": "user", "content": "again"}], PARAMS, use_tqdm=False),
        "generate_stream": lambda: next(llm.generate_stream(["again"], PARAMS)),
    }[call]
    with pytest.raises(RuntimeError, match="generate_stream"):
        again()
    rest = list(stream)  # the open stream is unharmed and finishes
    assert rest and rest[-1].finished
    assert llm.generate(["after"], PARAMS, use_tqdm=False)[0].finished  # and the engine is free again


def test_a_closed_stream_frees_the_engine(llm):
    stream = llm.generate_stream(["hello"], PARAMS)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.generate(["after"], PARAMS, use_tqdm=False)[0].finished


def test_another_thread_waits_for_the_stream(llm):
    stream = llm.generate_stream(["hello"], PARAMS)
    next(stream)
    results = []
    other = threading.Thread(target=lambda: results.append(llm.generate(["other"], PARAMS, use_tqdm=False)))
    other.start()
    other.join(0.5)
    assert other.is_alive() and not results  # waiting, not failing
    list(stream)
    other.join(60)
    assert not other.is_alive() and results[0][0].finished
