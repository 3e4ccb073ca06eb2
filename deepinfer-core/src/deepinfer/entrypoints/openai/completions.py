"""``POST /v1/completions``: one or more prompts (text or token ids), ``n`` completions each.

Choice ``index`` is ``prompt_position * n + completion_index`` (vLLM's), in responses and stream chunks.
``echo`` puts the prompt before each completion; with ``logprobs`` its tokens come with their logprobs too (the
first ``null``: nothing precedes it), which is how lm-evaluation-harness scores loglikelihood tasks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
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
from deepinfer.sampling_params import SamplingParams


def completion_logprobs(token_ids: list[int], logprobs: Sequence[PositionLogprobs | None] | None, k: int,
                        offset: int, token_text: Any = None) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object: tokens, their logprobs, the top ``k`` and text offsets.  A
    position without logprobs (a prompt's first token) is ``null``, its text from ``token_text(id)``."""
    if logprobs is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for token, position in zip(token_ids, logprobs, strict=True):
        chosen = position[token] if position is not None else None
        text = (chosen.decoded_token or "") if chosen is not None else (token_text(token) if token_text else "")
        tokens.append(text)
        values.append(chosen.logprob if chosen is not None else None)
        tops.append({lp.decoded_token or "": lp.logprob for lp in sorted(position.values(), key=lambda x: x.rank)
                     if lp.rank <= k} if k and position is not None else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two ``logprobs`` objects one after the other."""
    if a is None or b is None:
        return a or b
    return {key: a[key] + b[key] for key in a}


@dataclasses.dataclass(slots=True)
class _Echo:
    """A prompt as ``echo`` shows it: its text, and its tokens' logprobs object when logprobs were asked."""

    text: str
    logprobs: dict[str, Any] | None


def _echoes(body: CompletionRequest, state: ServerState, first: list[tuple[int, RequestOutput]]
            ) -> dict[int, _Echo]:
    """Per prompt position, what ``echo`` puts before its completions (from the first output of each prompt)."""
    if not body.echo:
        return {}
    tokenizer, skip = state.engine.tokenizer, body.skip_special_tokens

    def token_text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=skip) if tokenizer is not None else ""

    echoes = {}
    for i, out in first:
        text = out.prompt if out.prompt is not None else (
            tokenizer.decode(out.prompt_token_ids, skip_special_tokens=skip) if tokenizer is not None else "")
        lp = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, body.logprobs or 0, 0, token_text) \
            if body.logprobs is not None and out.prompt_logprobs is not None else None
        echoes[i] = _Echo(text, lp)
    return echoes


def _with_prompt_logprobs(body: CompletionRequest, params: SamplingParams) -> SamplingParams:
    """``prompt_logprobs`` from the request, or from ``logprobs`` when ``echo`` shows the prompt."""
    k = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        k = max(k or 0, body.logprobs)
    return params if k is None else dataclasses.replace(params, prompt_logprobs=k)


async def create_completion(body: CompletionRequest, raw: Request, state: ServerState) -> Response:
    state.check_model(body.model)
    params = state.sampling_params(
        lambda: _with_prompt_logprobs(body, body.sampling_params(body.max_tokens, body.logprobs)))
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
    echoes = _echoes(body, state, first)
    choices, usage = await gather_choices(first, rest, n, num_prompts, "prompt")
    k = body.logprobs or 0
    out = []
    for j, ch in enumerate(choices):
        echo = echoes.get(j // n, _Echo("", None))
        lp = completion_logprobs(ch.token_ids, ch.logprobs, k, len(echo.text))
        out.append({"index": j, "text": echo.text + ch.text, "finish_reason": ch.finish_reason,
                    "stop_reason": ch.stop_reason, "logprobs": _joined(echo.logprobs, lp)})
    return JSONResponse({"id": request_id, "object": "text_completion", "created": created(),
                         "model": state.model_name, "choices": out, "usage": usage.as_dict()})


async def _chunks(body: CompletionRequest, state: ServerState, request_id: str, n: int,
                  first: list[tuple[int, RequestOutput]], rest: AsyncGenerator[tuple[int, RequestOutput], None]
                  ) -> AsyncIterator[dict[str, Any]]:
    usage = Usage()
    offsets: dict[int, int] = {}
    echoes = _echoes(body, state, first)
    head = {"id": request_id, "object": "text_completion", "created": created(), "model": state.model_name}
    try:
        async for i, out in replay(first, rest):
            if out.error is not None:
                raise APIError(out.error, "prompt")
            choices = []
            for c in out.outputs:
                index = i * n + c.index
                echo = echoes.get(i, _Echo("", None)) if index not in offsets else _Echo("", None)
                offset = offsets.get(index, len(echo.text))
                lp = _joined(echo.logprobs, completion_logprobs(c.token_ids, c.logprobs, body.logprobs or 0, offset))
                offsets[index] = offset + len(c.text)
                usage.completion_tokens += len(c.token_ids)
                choices.append({"index": index, "text": echo.text + c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if out.finished:
                usage.prompt_tokens += len(out.prompt_token_ids)
            if choices:
                yield {**head, "choices": choices}
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error is its last event
        yield stream_error(exc)
        return
    if body.include_usage:
        yield {**head, "choices": [], "usage": usage.as_dict()}
