"""``POST /v1/chat/completions``: the conversation rendered by the chat template, ``n`` replies.

The template is ``--chat-template``, else the tokenizer's, else a plain ``User:`` / ``Assistant:`` transcript
(``deepinfer.engine.chat``).  Replies are plain assistant text (no tool calls, no reasoning split).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepinfer.engine.chat import ChatError, render_chat
from deepinfer.entrypoints.openai.protocol import ChatCompletionRequest
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


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], logprobs: list[PositionLogprobs] | None, k: int) -> dict[str, Any] | None:
    """``{"content": [{token, logprob, bytes, top_logprobs: [...k]}]}``."""
    if logprobs is None:
        return None
    content = []
    for token, position in zip(token_ids, logprobs, strict=True):
        chosen = position[token]
        top = [_entry(lp.decoded_token or "", lp.logprob) for lp in sorted(position.values(), key=lambda x: x.rank)
               if lp.rank <= k]
        content.append({**_entry(chosen.decoded_token or "", chosen.logprob), "top_logprobs": top})
    return {"content": content}


async def create_chat_completion(body: ChatCompletionRequest, raw: Request, state: ServerState) -> Response:
    state.check_model(body.model)
    params = state.sampling_params(lambda: body.sampling_params(body.output_limit(), body.num_logprobs()))
    try:
        prompt = await state.engine.run_in_worker(  # off the event loop: a long conversation renders for a while
            render_chat, state.engine.tokenizer, body.messages, state.chat_template, body.add_generation_prompt,
            body.chat_template_kwargs)
    except ChatError as exc:
        raise APIError(str(exc), "messages") from None
    request_id = new_id("chatcmpl")

    async def work() -> Response:
        first, rest = await start(state.engine, [prompt], params, request_id, "messages")
        if body.stream:
            return sse(_chunks(body, state, request_id, first, rest), on_close=rest.aclose)
        return await _respond(body, state, request_id, params.n, first, rest)

    return await unless_disconnected(raw, work())


async def _respond(body: ChatCompletionRequest, state: ServerState, request_id: str, n: int,
                   first: list[tuple[int, RequestOutput]], rest: AsyncGenerator[tuple[int, RequestOutput], None]
                   ) -> Response:
    choices, usage = await gather_choices(first, rest, n, 1, "messages")
    k = body.top_logprobs or 0
    return JSONResponse({
        "id": request_id, "object": "chat.completion", "created": created(), "model": state.model_name,
        "choices": [{"index": j, "message": {"role": "assistant", "content": ch.text},
                     "logprobs": chat_logprobs(ch.token_ids, ch.logprobs, k), "finish_reason": ch.finish_reason,
                     "stop_reason": ch.stop_reason} for j, ch in enumerate(choices)],
        "usage": usage.as_dict(),
    })


async def _chunks(body: ChatCompletionRequest, state: ServerState, request_id: str,
                  first: list[tuple[int, RequestOutput]], rest: AsyncGenerator[tuple[int, RequestOutput], None]
                  ) -> AsyncIterator[dict[str, Any]]:
    usage = Usage()
    started: set[int] = set()
    head = {"id": request_id, "object": "chat.completion.chunk", "created": created(), "model": state.model_name}
    try:
        async for _, out in replay(first, rest):
            if out.error is not None:
                raise APIError(out.error, "messages")
            choices = []
            for c in out.outputs:
                delta: dict[str, Any] = {"content": c.text}
                if c.index not in started:
                    started.add(c.index)
                    delta = {"role": "assistant", **delta}
                usage.completion_tokens += len(c.token_ids)
                choices.append({"index": c.index, "delta": delta, "finish_reason": c.finish_reason,
                                "logprobs": chat_logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0)})
            if out.finished:
                usage.prompt_tokens = len(out.prompt_token_ids)
            if choices:
                yield {**head, "choices": choices}
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error is its last event
        yield stream_error(exc)
        return
    if body.include_usage:
        yield {**head, "choices": [], "usage": usage.as_dict()}
