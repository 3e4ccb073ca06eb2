"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over one ``AsyncLLM``; see ``docs/serving.md``.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``; ``/tokenize``,
``/detokenize`` and the OpenAI-shaped 404 / 501s are ``extra_routes``'.  Every error is OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}`` (``errors.py``); request bodies are read within the server's
limits and validated strictly (``request_body.py``, ``limits.py``); the API key and the Host check are
``security.py``'s.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deepinfer.engine.async_llm import AsyncLLM
from deepinfer.entrypoints.openai import metrics
from deepinfer.entrypoints.openai.chat import create_chat_completion
from deepinfer.entrypoints.openai.completions import create_completion
from deepinfer.entrypoints.openai.errors import install_error_handlers
from deepinfer.entrypoints.openai.extra_routes import install_extra_routes
from deepinfer.entrypoints.openai.limits import limits_from_args
from deepinfer.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer.entrypoints.openai.request_body import parse_request
from deepinfer.entrypoints.openai.security import AccessGuard, HostPolicy, api_key, warn_if_exposed
from deepinfer.entrypoints.openai.serve_flags import chat_settings
from deepinfer.entrypoints.openai.serving import created
from deepinfer.entrypoints.openai.state import ServerState

logger = logging.getLogger(__name__)


def build_app(state: ServerState, key: str | None = None, hosts: HostPolicy | None = None) -> FastAPI:
    """The routes over ``state``; ``key``: the API key ``/v1/*`` requires; ``hosts``: the Host names answered
    (default any)."""
    app = FastAPI(title="DeepInfer", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(AccessGuard, key=key, hosts=hosts or HostPolicy(None))

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
        return Response(metrics.render(state.engine.stats, state.model_name), media_type=metrics.CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await create_completion(await parse_request(raw, CompletionRequest, state.limits), raw, state)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await create_chat_completion(await parse_request(raw, ChatCompletionRequest, state.limits), raw,
                                            state)

    @app.get("/version")
    async def version() -> JSONResponse:
        import deepinfer

        return JSONResponse({"version": deepinfer.__version__})

    install_extra_routes(app, state)
    return app


def _stop_on_sigterm() -> None:
    """uvicorn re-raises SIGTERM once it has shut down gracefully: exit normally then, so that the ``finally`` of
    :func:`run_server` stops the engine thread and the other ranks, instead of the process dying at once."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def run_server(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> None:
    """Load the model, start the engine thread and serve until interrupted (on several ranks: rank 0 serves and
    leads the others, docs/parallel.md)."""
    import uvicorn

    from deepinfer.engine.llm import LLM

    llm = LLM(**engine_kwargs)
    if llm.parallel is not None and llm.parallel.context.plan.rank != 0:
        llm.follow()  # torchrun's other ranks: rank 0 serves, they step with it until it stops
        return
    engine = AsyncLLM(llm)
    name = args.served_model_name or engine_kwargs.get("model") or (
        llm.model_path.name if llm.model_path is not None else "deepinfer")
    state = ServerState(engine, str(name), limits=limits_from_args(args), **chat_settings(args, llm))
    key = api_key(args.api_key)
    warn_if_exposed(args.host, key)
    if state.chat_format.name == "fallback":
        logger.warning("the tokenizer has no chat template: /v1/chat/completions renders conversations as a plain "
                       "'User: / Assistant:' transcript; pass --chat-template for the model's own format")
    logger.info("chat format %s (reasoning parser %s, tool parser %s)", state.chat_format.name,
                state.reasoning_parser, state.tool_parser)
    logger.info("serving %s on http://%s:%d (OpenAI-compatible: /v1/completions, /v1/chat/completions)",
                state.model_name, args.host, args.port)
    app = build_app(state, key, HostPolicy.for_bind(args.host, args.allowed_hosts))
    _stop_on_sigterm()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
        llm.shutdown()  # the other ranks exit
