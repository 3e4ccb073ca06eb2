"""Per-request limits of the server, each a ``deepinfer serve`` flag, so that one request cannot take the server's
memory or the engine thread's time for itself.

A request over a limit is refused before it reaches the engine: a body over ``--max-request-body-bytes`` with a
413, a count over its limit with a 400 whose ``param`` is the field and whose message names the flag.  The
defaults (``docs/serving.md``, "Limits and security") leave room for a ``max_model_len`` of a million tokens
sent as token ids, OpenAI's 128 tools, and agent conversations of thousands of messages.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any

from deepinfer.entrypoints.openai.protocol import RequestFieldError


def _limit(default: int, what: str) -> Any:
    return field(default=default, metadata={"help": what})


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one request may hold (see the module docstring); each field is the flag ``--max-...``."""

    max_request_body_bytes: int = _limit(32 * 1024 * 1024, "bytes of one request body (413 over it)")
    max_prompts_per_request: int = _limit(1024, "prompts in one /v1/completions request")
    max_stop_sequences: int = _limit(64, "entries of stop, and of stop_token_ids (each is checked at every step)")
    max_stop_sequence_length: int = _limit(1024, "characters of one stop string (searched for at every step)")
    max_messages: int = _limit(2048, "messages of one chat conversation")
    max_tools: int = _limit(128, "tool definitions of one chat request (OpenAI's limit)")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{_flag(f.name)} must be an integer >= 1, got {value!r}")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One ``--max-...`` flag per :class:`ServerLimits` field, its default the field's."""
    group = parser.add_argument_group("request limits (docs/serving.md, 'Limits and security')")
    for f in fields(ServerLimits):
        group.add_argument(f"--{_flag(f.name)}", type=int, default=f.default,
                           help=f"{f.metadata['help']} (default {f.default})")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})


def _refuse(param: str, what: str, count: int, name: str, limits: ServerLimits) -> RequestFieldError:
    limit = getattr(limits, name)
    return RequestFieldError(param, f"{param}: {count} {what}; this server takes at most {limit} (--{_flag(name)})")


def _num_prompts(prompt: Any) -> int:
    """Prompts of a validated ``prompt`` field: one text or one token list, or a list of either."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def check_counts(body: Any, limits: ServerLimits) -> None:
    """Raise ``RequestFieldError`` (a 400 naming the field) when a validated request body holds more than
    ``limits`` allow."""
    if hasattr(body, "prompt") and (n := _num_prompts(body.prompt)) > limits.max_prompts_per_request:
        raise _refuse("prompt", "prompts in one request", n, "max_prompts_per_request", limits)
    if (messages := getattr(body, "messages", None)) is not None and len(messages) > limits.max_messages:
        raise _refuse("messages", "messages", len(messages), "max_messages", limits)
    if (tools := getattr(body, "tools", None)) is not None and len(tools) > limits.max_tools:
        raise _refuse("tools", "tool definitions", len(tools), "max_tools", limits)
    stop = getattr(body, "stop", None)
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > limits.max_stop_sequences:
        raise _refuse("stop", "stop strings", len(stops), "max_stop_sequences", limits)
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_sequence_length:
        raise _refuse("stop", "characters in a stop string", longest, "max_stop_sequence_length", limits)
    if (ids := getattr(body, "stop_token_ids", None)) is not None and len(ids) > limits.max_stop_sequences:
        raise _refuse("stop_token_ids", "stop token ids", len(ids), "max_stop_sequences", limits)
