"""Tokenizing, chat rendering and grammar compilation happen off the engine thread and off the event loop: a
request that takes seconds to prepare delays only itself, never the tokens of a stream already running
(deliberately slow tokenizer stubs)."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

from deepinfer import RequestOutputKind, SamplingParams
from tests.support.app_client import client_for, toy_async_engine
from tests.support.toy_model import toy_tokenizer

SLOW_S = 1.5
#: An inter-token gap this long means the running stream waited for the slow preparation.
STALL_S = SLOW_S / 2


def _slow_tokenizer():
    """The toy tokenizer, but text or a conversation that says SLOW takes ``SLOW_S`` to encode / render (sleeping
    releases the GIL, as a fast tokenizer's Rust core does)."""
    tok = toy_tokenizer()
    encode, render = tok.encode, tok.apply_chat_template

    def slow_encode(text, *args, **kwargs):
        if "SLOW" in text:
            time.sleep(SLOW_S)
        return encode(text, *args, **kwargs)

    def slow_render(messages, *args, **kwargs):
        if any("SLOW" in m["content"] for m in messages):
            time.sleep(SLOW_S)
        return render(messages, *args, **kwargs)

    tok.encode, tok.apply_chat_template = slow_encode, slow_render
    return tok


@pytest.fixture(scope="module")
def engine():
    engine = toy_async_engine(tokenizer=_slow_tokenizer())
    yield engine
    engine.shutdown()


async def _gaps_while(engine, slow_request) -> tuple[float, float, int]:
    """Stream a long request; once it runs, await ``slow_request()``.  Returns the longest gap between the
    stream's outputs while the slow request was in flight, how long it took, and the outputs in that time."""
    params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    times: list[float] = []
    stream = engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "running")

    done: list[float] = []

    async def consume():
        async for _ in stream:
            times.append(time.monotonic())
        done.append(time.monotonic())  # a fast host may finish the stream first: no gap is measured past it

    consumer = asyncio.create_task(consume())
    while len(times) < 3:
        await asyncio.sleep(0.005)
    start = time.monotonic()
    await slow_request()
    end = time.monotonic()
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)
    during = [t for t in times if start <= t <= end]
    marks = [start, *during, min([end, *done])]
    return max(b - a for a, b in zip(marks, marks[1:], strict=False)), end - start, len(during)


def test_a_slow_prompt_does_not_stall_a_running_stream(engine):
    async def slow():
        outs = [o async for o in engine.generate("a SLOW story", SamplingParams(max_tokens=2), "slow")]
        assert outs[-1].finished and outs[-1].error is None

    gap, took, count = asyncio.run(_gaps_while(engine, slow))
    assert took >= SLOW_S  # the stub did run: the request waited for its own tokenization
    assert gap < STALL_S and count > 3, (gap, count)


def test_a_prompt_rejected_after_tokenizing_fails_alone(engine):
    async def too_long():
        text = "SLOW " + "one two three " * 2000  # longer than the toy's max_model_len once tokenized
        outs = [o async for o in engine.generate(text, SamplingParams(max_tokens=2), "long")]
        assert "max_model_len" in outs[-1].error

    gap, _, count = asyncio.run(_gaps_while(engine, too_long))
    assert gap < STALL_S and count > 3, (gap, count)
    assert engine.stats.requests["error"] >= 1


def test_chat_rendering_does_not_block_the_event_loop(engine):
    """Through the HTTP app: the route awaits the template in the worker pool, so the stream in the same event
    loop keeps receiving."""
    app = client_for(engine).app

    async def slow_chat():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            response = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "a SLOW chat"}], "max_tokens": 2}, timeout=30)
        assert response.status_code == 200, response.text

    gap, took, count = asyncio.run(_gaps_while(engine, slow_chat))
    assert took >= SLOW_S and gap < STALL_S and count > 3, (gap, count)


def test_grammars_compile_in_the_worker_pool(engine, monkeypatch):
    """The engine thread finds a request's grammar compiled (xgrammar can take seconds on a large schema); an
    invalid one is refused by the worker with the engine's message."""
    from deepinfer.structured.compiler import GrammarCompiler

    threads = []
    compile_now = GrammarCompiler._compile_now

    def recording(self, spec):
        threads.append(threading.current_thread().name)
        return compile_now(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile_now", recording)

    async def run(so_args):
        params = SamplingParams(temperature=0, max_tokens=4, so_args=so_args)
        return [o async for o in engine.generate({"prompt_token_ids": [5, 6]}, params, f"g{len(threads)}")][-1]

    out = asyncio.run(run({"regex": "(yes|no)x{0,3}"}))
    assert out.error is None and re.fullmatch("(yes|no)x{0,3}", out.outputs[0].text)
    bad = asyncio.run(run({"regex": "(unclosed"}))
    assert bad.error.startswith("so_args['regex']: invalid")
    assert threads and all(name.startswith("deepinfer-prep") for name in threads), threads
