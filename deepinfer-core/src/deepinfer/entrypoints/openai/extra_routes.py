"""vLLM's ``/tokenize`` and ``/detokenize``, and OpenAI-shaped answers for routes this server does not have.

``POST /tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...], "tools"?,
"add_generation_prompt"?, "chat_template_kwargs"?, "reasoning_effort"?}`` (rendered by the chat format) ->
``{"count", "max_model_len", "tokens", "token_strs"?}``.  ``POST /detokenize``: ``{"tokens": [...]}`` ->
``{"prompt": text}``.  ``/v1/embeddings``, ``/v1/responses`` and other OpenAI endpoints not built are 501s; an
unknown route is a 404 (and a wrong method a 405), all as ``{"error": {...}}``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from deepinfer.chat.messages import ChatError
from deepinfer.chat.template import render_prompt
from deepinfer.entrypoints.openai.serving import APIError
from deepinfer.entrypoints.openai.state import ServerState

#: OpenAI endpoints DeepInfer has not built (a 501 naming what exists).
NOT_BUILT = ("/v1/embeddings", "/v1/responses", "/v1/audio/transcriptions", "/v1/audio/speech",
             "/v1/images/generations", "/v1/moderations", "/v1/files", "/v1/batches", "/v1/fine_tuning/jobs")
_BUILT = "/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics, /version"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | int | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _tokenize(body: TokenizeRequest, state: ServerState) -> list[int]:
    tokenizer = state.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give prompt or messages (one of them)", "prompt")
    if body.prompt is not None:
        return list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    options = {**state.default_chat_template_kwargs, **(body.chat_template_kwargs or {})}
    if body.reasoning_effort is not None:
        options["reasoning_effort"] = body.reasoning_effort
    try:
        return render_prompt(tokenizer, state.chat_format, body.messages, body.tools, body.add_generation_prompt,
                             options)["prompt_token_ids"]
    except ChatError as exc:
        raise APIError(str(exc), "messages") from None


def install_extra_routes(app: FastAPI, state: ServerState) -> None:
    """Add the routes above and the handler that shapes 404 / 405 / 501 answers as OpenAI errors."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        ids = _tokenize(body, state)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.llm.engine.config.max_model_len,
                               "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = state.engine.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        vocab = len(state.engine.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens must be ids in [0, {vocab}), got {bad[:5]}", "tokens")
        return {"prompt": state.engine.tokenizer.decode(body.tokens)}

    for path in NOT_BUILT:
        app.add_api_route(path, _not_built, methods=["GET", "POST"], include_in_schema=False)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return APIError(f"{request.url.path} is not a route of this server ({_BUILT})", status=404,
                            kind="NotFoundError").response()
        if exc.status_code == 405:
            return APIError(f"{request.method} is not allowed on {request.url.path}", status=405,
                            kind="invalid_request_error").response()
        return APIError(str(exc.detail), status=exc.status_code).response()


async def _not_built(request: Request) -> Response:
    return APIError(f"{request.url.path} is not implemented by DeepInfer; it serves {_BUILT}", status=501,
                    kind="not_implemented_error").response()
