"""What both generation endpoints share: running a request's prompts on the async engine (merged, rejections
found before anything is sent), accumulating deltas, SSE framing and usage.  Errors: ``errors.py``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from deepinfer.engine.async_llm import AsyncLLM
from deepinfer.entrypoints.openai.errors import APIError, internal_error, param_of
from deepinfer.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from deepinfer.sampling_params import SamplingParams


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(slots=True)
class Choice:
    """One completion's deltas, accumulated (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: CompletionOutput) -> None:
        self.text += c.text
        self.token_ids += c.token_ids
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + c.logprobs
        self.finish_reason = c.finish_reason or self.finish_reason
        self.stop_reason = c.stop_reason if c.finish_reason else self.stop_reason


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Outputs of several requests as they come, tagged with the request's position.  Closing this generator
    closes the requests' streams, which aborts the unfinished ones."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def start(engine: AsyncLLM, prompts: list[Any], params: SamplingParams, request_id: str,
                param: str = "prompt"
                ) -> tuple[list[tuple[int, RequestOutput]], AsyncGenerator[tuple[int, RequestOutput], None]]:
    """Submit every prompt and wait for each one's first output, so that a rejected prompt fails the whole
    HTTP request (400) before a byte is sent: its ``param`` is the sampling field the engine names, else
    ``param`` (``prompt[i]`` for the i-th).  Returns those first outputs and the stream of the rest."""
    merged = _merge([engine.generate(p, params, f"{request_id}-{i}") for i, p in enumerate(prompts)])
    first: list[tuple[int, RequestOutput]] = []
    seen: set[int] = set()
    try:
        async for i, out in merged:
            if out.error is not None:
                raise APIError(out.error, param_of(out.error) or (param if i == 0 else f"{param}[{i}]"))
            first.append((i, out))
            seen.add(i)
            if len(seen) == len(prompts):
                break
    except BaseException:
        await merged.aclose()
        raise
    return first, merged


async def replay(first: list[tuple[int, RequestOutput]], rest: AsyncGenerator[tuple[int, RequestOutput], None]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs ``start`` returned, then the rest of the stream."""
    for item in first:
        yield item
    async for item in rest:
        yield item


async def gather_choices(first: list[tuple[int, RequestOutput]],
                         rest: AsyncGenerator[tuple[int, RequestOutput], None], n: int, num_prompts: int,
                         param: str) -> tuple[list[Choice], Usage]:
    """A non-streaming response's choices (``prompt_position * n + completion_index``) and usage, from every
    output of the requests; a failed request raises :class:`APIError` naming ``param``."""
    choices = [Choice() for _ in range(num_prompts * n)]
    usage = Usage()
    async for i, out in replay(first, rest):
        if out.error is not None:
            raise APIError(out.error, param)
        for c in out.outputs:
            choices[i * n + c.index].add(c)
            usage.completion_tokens += len(c.token_ids)
        if out.finished:
            usage.prompt_tokens += len(out.prompt_token_ids)
    return choices, usage


async def until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only ``http.disconnect`` is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Run ``work`` (a coroutine building a response) and cancel it if the client disconnects first, which
    aborts its requests in the engine."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        return Response(status_code=499)  # nobody reads it
    finally:
        watcher.cancel()
        if not task.done():  # the client left, or this handler itself was cancelled (shutdown)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def sse(events: AsyncIterator[dict[str, Any]], on_close: Callable[[], Any] | None = None) -> StreamingResponse:
    """Server-sent events: one ``data: {json}`` per event, then ``data: [DONE]``."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if on_close is not None:
                await on_close()

    return StreamingResponse(body(), media_type="text/event-stream")


def stream_error(exc: BaseException) -> dict[str, Any]:
    """The last event of a stream that failed: a request error as it is, anything else by its logged id."""
    return (exc if isinstance(exc, APIError) else internal_error(exc)).body()


def created() -> int:
    return int(time.time())
