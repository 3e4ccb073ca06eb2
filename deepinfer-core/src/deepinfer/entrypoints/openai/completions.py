"""``POST /v1/completions``: one or more prompts (text or token ids), ``n`` completions each.

Choice ``index`` is ``prompt_position * n + completion_index`` (vLLM's), in responses and stream chunks.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepinfer.entrypoints.openai.protocol import CompletionRequest
from deepinfer.entrypoints.openai.serving import (
    APIError,
    Usage,
    created,
    gather_choices,
    new_id,
    replay,
    sse,
    start,
    stream_error,
    unless_disconnected,
)
from deepinfer.entrypoints.openai.state import ServerState
from deepinfer.outputs import PositionLogprobs, RequestOutput


def completion_logprobs(token_ids: list[int], logprobs: list[PositionLogprobs] | None, k: int,
                        offset: int) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object: tokens, their logprobs, the top ``k`` and text offsets."""
    if logprobs is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for token, position in zip(token_ids, logprobs, strict=True):
        chosen = position[token]
        text = chosen.decoded_token or ""
        tokens.append(text)
        values.append(chosen.logprob)
        tops.append({lp.decoded_token or "": lp.logprob for lp in sorted(position.values(), key=lambda x: x.rank)
                     if lp.rank <= k} if k else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


async def create_completion(body: CompletionRequest, raw: Request, state: ServerState) -> Response:
    state.check_model(body.model)
    params = state.sampling_params(lambda: body.sampling_params(body.max_tokens, body.logprobs))
    prompts = body.prompts()
    request_id = new_id("cmpl")

    async def work() -> Response:
        first, rest = await start(state.engine, prompts, params, request_id)
        if body.stream:
            return sse(_chunks(body, state, request_id, params.n, first, rest), on_close=rest.aclose)
        return await _respond(body, state, request_id, params.n, len(prompts), first, rest)

    return await unless_disconnected(raw, work())


async def _respond(body: CompletionRequest, state: ServerState, request_id: str, n: int, num_prompts: int,
                   first: list[tuple[int, RequestOutput]], rest: AsyncGenerator[tuple[int, RequestOutput], None]
                   ) -> Response:
    choices, usage = await gather_choices(first, rest, n, num_prompts, "prompt")
    k = body.logprobs or 0
    return JSONResponse({
        "id": request_id, "object": "text_completion", "created": created(), "model": state.model_name,
        "choices": [{"index": j, "text": ch.text, "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason,
                     "logprobs": completion_logprobs(ch.token_ids, ch.logprobs, k, 0)}
                    for j, ch in enumerate(choices)],
        "usage": usage.as_dict(),
    })


async def _chunks(body: CompletionRequest, state: ServerState, request_id: str, n: int,
                  first: list[tuple[int, RequestOutput]], rest: AsyncGenerator[tuple[int, RequestOutput], None]
                  ) -> AsyncIterator[dict[str, Any]]:
    usage = Usage()
    offsets: dict[int, int] = {}
    head = {"id": request_id, "object": "text_completion", "created": created(), "model": state.model_name}
    try:
        async for i, out in replay(first, rest):
            if out.error is not None:
                raise APIError(out.error, "prompt")
            choices = []
            for c in out.outputs:
                index = i * n + c.index
                lp = completion_logprobs(c.token_ids, c.logprobs, body.logprobs or 0, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(c.text)
                usage.completion_tokens += len(c.token_ids)
                choices.append({"index": index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
            if out.finished:
                usage.prompt_tokens += len(out.prompt_token_ids)
            if choices:
                yield {**head, "choices": choices}
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error is its last event
        yield stream_error(exc)
        return
    if body.include_usage:
        yield {**head, "choices": [], "usage": usage.as_dict()}
