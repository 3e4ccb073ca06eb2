"""Every failure in OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``.

Request errors name the field (``param``); a route that does not exist is a 404, a wrong method a 405.  An
internal error (a bug, a failed engine step) is logged with its traceback under a fresh id, and the client gets
only that id: exception text can carry paths, tensor shapes or other users' data, so it never leaves the server.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from deepinfer.entrypoints.openai.protocol import RequestFieldError
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


#: How deep objects and arrays may nest in a request body (the recursion limit of pydantic's JSON parser).
MAX_JSON_DEPTH = 200

_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {"so_args"}
#: SamplingParams field -> the request field that sets it, where they differ.
_REQUEST_NAMES = {"seq_seed": "seed"}


def param_of(message: str) -> str | None:
    """The request field a ``SamplingParams`` or engine error message starts with (they name the field first:
    ``stop_token_ids [...] are outside the vocabulary``, ``so_args['regex']: ...``), else None."""
    match = re.match(r"[a-z_]+", message)
    name = match.group() if match else ""
    return _REQUEST_NAMES.get(name, name) if name in _SAMPLING_FIELDS else None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "any"}


def internal_error(exc: BaseException) -> APIError:
    """A 500 that names an id; the exception and its traceback are logged under that id."""
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    logger.error("internal error %s (%s)", error_id, type(exc).__name__, exc_info=exc)
    return APIError(f"internal server error (id {error_id}); the server log has the details under that id",
                    status=500, kind="server_error")


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


def _shown(value: Any) -> str:
    """``type value`` with the value cut short (a prompt may be megabytes)."""
    text = repr(value[:41] if isinstance(value, (str, bytes, list, tuple)) else value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def validation_error(errors: list[Any]) -> APIError:
    """The first field pydantic refused, as a 400 naming it (every form a union field was tried against) and
    the value it got, so ``"max_tokens": "16"`` reads ``max_tokens: Input should be a valid integer (got str
    '16')``."""
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    param = _field(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return APIError(f"unknown or unsupported parameter {param!r} (docs/serving.md lists the parameters)", param)
    if first.get("type") == "json_invalid":
        msg = str(first.get("msg"))
        if "recursion limit" in msg:
            return APIError(f"the request body nests objects and arrays more than {MAX_JSON_DEPTH} deep ({msg})", None)
        return APIError(f"the request body is not valid JSON ({msg})", None)
    if first.get("type") == "model_type" and param is None:
        return APIError(f"the request body must be a JSON object, got {_shown(first.get('input'))}", None)
    messages = list(dict.fromkeys(str(e.get("msg")) for e in errors if _field(tuple(e.get("loc", ()))) == param))
    got = f" (got {_shown(first['input'])})" if "input" in first and not isinstance(first["input"], dict) else ""
    return APIError(f"{param or 'body'}: {'; or: '.join(messages)}{got}", param)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every exception a route raises in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestFieldError)
    async def _field_error(_: Request, exc: RequestFieldError) -> Response:
        return APIError(str(exc), exc.param).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        message = {404: f"no route {request.url.path!r} (the API is under /v1: docs/serving.md, 'Endpoints')",
                   405: f"{request.method} is not allowed on {request.url.path!r}"}.get(exc.status_code,
                                                                                   str(exc.detail))
        response = APIError(message, status=exc.status_code).response()
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        return internal_error(exc).response()
