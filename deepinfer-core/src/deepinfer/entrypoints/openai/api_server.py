"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over one ``AsyncLLM``; see ``docs/serving.md``.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``; ``/tokenize``,
``/detokenize`` and the OpenAI-shaped 404 / 501s are ``extra_routes``'.  Errors are
OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: a malformed body, an unknown field or a
value out of range is a 400 naming the field.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from deepinfer.engine.async_llm import AsyncLLM
from deepinfer.entrypoints.openai import metrics
from deepinfer.entrypoints.openai.chat import create_chat_completion
from deepinfer.entrypoints.openai.completions import create_completion
from deepinfer.entrypoints.openai.extra_routes import install_extra_routes
from deepinfer.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, RequestFieldError
from deepinfer.entrypoints.openai.serve_flags import chat_settings
from deepinfer.entrypoints.openai.serving import APIError, created
from deepinfer.entrypoints.openai.state import ServerState

logger = logging.getLogger(__name__)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "any"}


def _field(loc: tuple[Any, ...]) -> str | None:
    """The request field of a pydantic error location: ``body`` and union-branch tags (``list[int]``) dropped,
    list indices kept (``prompt.1``)."""
    parts = []
    for p in loc:
        tag = str(p)
        if p == "body" or (isinstance(p, str) and ("[" in tag or tag.split("-")[0].lower() in _TYPE_TAGS)):
            continue
        parts.append(tag)
    return ".".join(parts) or None


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first field pydantic refused, as a 400 naming it (every form a union field was tried against)."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    param = _field(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return APIError(f"unknown or unsupported parameter {param!r} (docs/serving.md lists the parameters)", param)
    if first.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON ({first.get('msg')})", None)
    messages = list(dict.fromkeys(str(e.get("msg")) for e in errors if _field(tuple(e.get("loc", ()))) == param))
    return APIError(f"{param or 'body'}: {'; or: '.join(messages)}", param)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="DeepInfer", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestFieldError)
    async def _field_error(_: Request, exc: RequestFieldError) -> Response:
        return APIError(str(exc), exc.param).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("request failed")
        return APIError(f"{type(exc).__name__}: {exc}", status=500, kind="server_error").response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.engine.is_running else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        llm = state.engine.llm
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": created(), "owned_by": "deepinfer",
            "root": str(llm.model_path) if llm.model_path is not None else state.model_name,
            "max_model_len": llm.engine.config.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(state.engine.stats, state.model_name), media_type=metrics.CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(body, raw, state)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(body, raw, state)

    @app.get("/version")
    async def version() -> JSONResponse:
        import deepinfer

        return JSONResponse({"version": deepinfer.__version__})

    install_extra_routes(app, state)
    return app


def run_server(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> None:
    """Load the model, start the engine thread and serve until interrupted."""
    import uvicorn

    from deepinfer.engine.llm import LLM

    llm = LLM(**engine_kwargs)
    engine = AsyncLLM(llm)
    name = args.served_model_name or engine_kwargs.get("model") or (
        llm.model_path.name if llm.model_path is not None else "deepinfer")
    state = ServerState(engine, str(name), **chat_settings(args, llm))
    if state.chat_format.name == "fallback":
        logger.warning("the tokenizer has no chat template: /v1/chat/completions renders conversations as a plain "
                       "'User: / Assistant:' transcript; pass --chat-template for the model's own format")
    logger.info("chat format %s (reasoning parser %s, tool parser %s)", state.chat_format.name,
                state.reasoning_parser, state.tool_parser)
    logger.info("serving %s on http://%s:%d (OpenAI-compatible: /v1/completions, /v1/chat/completions)",
                state.model_name, args.host, args.port)
    try:
        uvicorn.run(build_app(state), host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
