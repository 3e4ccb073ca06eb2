"""``POST /v1/chat/completions``: the conversation rendered by the model's chat format, ``n`` replies.

The format is ``--chat-template``, else the tokenizer's, else the DeepSeek-V4.1 format for V4.1 checkpoints,
else a plain ``User:`` / ``Assistant:`` transcript (``deepinfer.chat.template``).  With a reasoning parser the
reply's reasoning comes as ``reasoning_content``; with a tool parser and tools its DSML calls as ``tool_calls``
(``finish_reason: "tool_calls"``), streamed as deltas (``chat_request`` decides which parsers run).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepinfer.chat.dsml import ToolCall
from deepinfer.chat.parsers import ReplyParser
from deepinfer.entrypoints.openai.chat_request import ChatPlan, plan_chat
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
from deepinfer.outputs import CompletionOutput, PositionLogprobs, RequestOutput


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


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """One call in OpenAI's shape (``index`` in stream deltas)."""
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


async def create_chat_completion(body: ChatCompletionRequest, raw: Request, state: ServerState) -> Response:
    state.check_model(body.model)
    params = state.sampling_params(lambda: body.sampling_params(body.output_limit(), body.num_logprobs()))
    plan = await state.engine.run_in_worker(plan_chat, body, state)  # off the event loop: rendering takes a while
    params = plan.sampling_params(params, body)
    request_id = new_id("chatcmpl")

    async def work() -> Response:
        first, rest = await start(state.engine, [plan.prompt], params, request_id, "messages")
        if body.stream:
            return sse(_chunks(body, state, plan, request_id, first, rest), on_close=rest.aclose)
        return await _respond(body, state, plan, request_id, params.n, first, rest)

    return await unless_disconnected(raw, work())


def _message(plan: ChatPlan, text: str) -> dict[str, Any]:
    """The assistant message of one whole reply, read by the plan's parsers."""
    if not plan.parses:
        return {"role": "assistant", "content": text}
    reply = ReplyParser.parse(text, plan.reasoning_parser, plan.tool_parser, plan.prompt["prompt"])
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
    if plan.reasoning_parser is not None:
        message["reasoning_content"] = reply.reasoning or None
    if reply.tool_calls:
        message["tool_calls"] = [tool_call_json(c) for c in reply.tool_calls]
    return message


async def _respond(body: ChatCompletionRequest, state: ServerState, plan: ChatPlan, request_id: str, n: int,
                   first: list[tuple[int, RequestOutput]], rest: AsyncGenerator[tuple[int, RequestOutput], None]
                   ) -> Response:
    choices, usage = await gather_choices(first, rest, n, 1, "messages")
    k = body.top_logprobs or 0
    out = []
    for j, ch in enumerate(choices):
        message = _message(plan, ch.text)
        out.append({"index": j, "message": message, "logprobs": chat_logprobs(ch.token_ids, ch.logprobs, k),
                    "finish_reason": _finish_reason(ch.finish_reason, "tool_calls" in message),
                    "stop_reason": ch.stop_reason})
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": created(),
                         "model": state.model_name, "choices": out, "usage": usage.as_dict()})


class _ChoiceDeltas:
    """Per streamed choice: its reply parser, the calls it has sent (their indices), whether its role went out."""

    __slots__ = ("plan", "parsers", "calls", "started")

    def __init__(self, plan: ChatPlan):
        self.plan = plan
        self.parsers: dict[int, ReplyParser] = {}
        self.calls: dict[int, int] = {}
        self.started: set[int] = set()

    def delta(self, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """The ``delta`` and ``finish_reason`` of one output of choice ``c.index``."""
        delta: dict[str, Any] = {} if c.index in self.started else {"role": "assistant"}
        self.started.add(c.index)
        if not self.plan.parses:
            return {**delta, "content": c.text}, c.finish_reason
        parser = self.parsers.setdefault(c.index, self.plan.reply_parser())
        reply = parser.feed(c.text)
        if c.finish_reason is not None:
            reply.add(parser.finish())
        before = self.calls.get(c.index, 0)
        self.calls[c.index] = before + len(reply.tool_calls)
        if reply.reasoning:
            delta["reasoning_content"] = reply.reasoning
        if reply.content:
            delta["content"] = reply.content
        if reply.tool_calls:
            delta["tool_calls"] = [tool_call_json(call, before + i) for i, call in enumerate(reply.tool_calls)]
        return delta, _finish_reason(c.finish_reason, self.calls[c.index] > 0)


async def _chunks(body: ChatCompletionRequest, state: ServerState, plan: ChatPlan, request_id: str,
                  first: list[tuple[int, RequestOutput]], rest: AsyncGenerator[tuple[int, RequestOutput], None]
                  ) -> AsyncIterator[dict[str, Any]]:
    usage = Usage()
    deltas = _ChoiceDeltas(plan)
    head = {"id": request_id, "object": "chat.completion.chunk", "created": created(), "model": state.model_name}
    try:
        async for _, out in replay(first, rest):
            if out.error is not None:
                raise APIError(out.error, "messages")
            choices = []
            for c in out.outputs:
                delta, finish_reason = deltas.delta(c)
                usage.completion_tokens += len(c.token_ids)
                choices.append({"index": c.index, "delta": delta, "finish_reason": finish_reason,
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
