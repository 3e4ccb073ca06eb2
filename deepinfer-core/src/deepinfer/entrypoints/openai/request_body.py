"""Reading a request body: JSON only, bounded in size, strict UTF-8, parsed and validated in one pass.

The body is read as it arrives and refused (413) once it passes ``--max-request-body-bytes``, before the rest is
read; a ``Content-Length`` over the limit is refused before anything is read.  The JSON parser (pydantic's)
refuses nesting deeper than 200 levels.  Every refusal is a 4xx in OpenAI's shape (``errors.py``).
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from deepinfer.entrypoints.openai.errors import MAX_JSON_DEPTH, APIError, validation_error
from deepinfer.entrypoints.openai.limits import ServerLimits, check_counts

M = TypeVar("M", bound=BaseModel)


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than {limit} bytes (--max-request-body-bytes)", status=413)


def check_content_type(request: Request) -> None:
    """JSON, in UTF-8 (RFC 8259): anything else is a 415, as vLLM answers it."""
    media_type, *options = (part.strip().lower() for part in request.headers.get("content-type", "").split(";"))
    charset = next((o.split("=", 1)[1].strip('"') for o in options if o.startswith("charset=")), "utf-8")
    if media_type != "application/json" or charset not in ("utf-8", "utf8"):
        given = request.headers.get("content-type")
        raise APIError("the request body must be JSON in UTF-8 ('Content-Type: application/json'), got "
                       + (repr(given) if given is not None else "no Content-Type"), status=415)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused as soon as it is known to pass ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


#: A JSON string (escapes included) or a structural character.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]:,]')


def field_at(text: str, offset: int | None = None, max_depth: int | None = None, levels: int = 3) -> str | None:
    """The field (``messages.0.content``, at most ``levels`` deep) of raw JSON ``text`` at character ``offset``,
    or where its nesting first passes ``max_depth``: the ``param`` of a body that does not parse."""
    frames: list[list[Any]] = []  # per open container: [is_object, current key or index]
    in_key = False
    for m in _TOKEN.finditer(text):
        token = m.group()
        if offset is not None and m.end() > offset:
            if in_key and frames:
                frames[-1][1] = None  # the offset is in a key: the field is the object's
            break
        if token in "{[":
            frames.append([token == "{", None if token == "{" else 0])
            in_key = token == "{"
            if max_depth is not None and len(frames) > max_depth:
                break
        elif token in "}]":
            frames = frames[:-1]
        elif token == ",":
            in_key = bool(frames) and frames[-1][0]
            if frames and not frames[-1][0]:
                frames[-1][1] += 1
        elif token == ":":
            in_key = False
        elif in_key and frames:
            frames[-1][1] = token[1:-1]
    path = [str(key) for _, key in frames if key is not None]
    return ".".join(path[:levels]) or None


def decode_utf8(body: bytes) -> str:
    """The body as text; invalid UTF-8 is a 400 naming the field that holds it."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        text = body.decode("utf-8", "surrogateescape")
        at = len(body[: exc.start].decode("utf-8"))
        raise APIError(f"the request body is not valid UTF-8 (byte 0x{body[exc.start]:02x} at offset {exc.start})",
                       field_at(text, offset=at)) from None


async def parse_request(request: Request, model: type[M], limits: ServerLimits) -> M:
    """The request's JSON body as ``model``, within ``limits``; a 4xx naming what is wrong otherwise."""
    check_content_type(request)
    text = decode_utf8(await read_body(request, limits.max_request_body_bytes))
    try:
        body = model.model_validate_json(text)
    except ValidationError as exc:
        error = validation_error(list(exc.errors()))
        if "recursion limit" in error.message:
            error.param = field_at(text, max_depth=MAX_JSON_DEPTH, levels=1)
        raise error from None
    check_counts(body, limits)
    return body
