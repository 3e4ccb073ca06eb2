"""What every route handler needs: the async engine, the served model's name, the chat format and its parsers,
the limits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer.chat.template import ChatFormat, JinjaFormat
from deepinfer.engine.async_llm import AsyncLLM
from deepinfer.entrypoints.openai.errors import APIError, param_of
from deepinfer.entrypoints.openai.limits import ServerLimits
from deepinfer.entrypoints.openai.protocol import RequestFieldError
from deepinfer.sampling_params import SamplingParams


@dataclass(slots=True)
class ServerState:
    engine: AsyncLLM
    model_name: str
    #: ``--chat-template``; None: the tokenizer's (or the plain fallback).
    chat_template: str | None = None
    #: What one request may hold (``--max-request-body-bytes``, ...).
    limits: ServerLimits = ServerLimits()
    #: The chat format (``--tokenizer-mode deepseek_v41`` forces V4.1's); None: ``--chat-template`` if given,
    #: else the engine's (``LLM.chat_format``).
    forced_format: ChatFormat | None = None
    #: ``--reasoning-parser`` / ``--tool-call-parser`` (default: the chat format's, e.g. deepseek_v41 for V4.1).
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    #: ``tool_choice: "auto"`` allowed (``--enable-auto-tool-choice``; on when the tool parser is the format's).
    auto_tool_choice: bool = False
    #: ``--default-chat-template-kwargs``: under every request's ``chat_template_kwargs``.
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def chat_format(self) -> ChatFormat:
        if self.forced_format is not None:
            return self.forced_format
        if self.chat_template is not None:
            return JinjaFormat(self.engine.tokenizer, self.chat_template)
        return self.engine.llm.chat_format

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"The model `{name}` does not exist; this server serves `{self.model_name}`", "model",
                           status=404, kind="NotFoundError")

    @staticmethod
    def sampling_params(build: Callable[[], SamplingParams]) -> SamplingParams:
        """``build()``, its errors as 400s naming the request field."""
        try:
            return build()
        except RequestFieldError as exc:
            raise APIError(str(exc), exc.param) from None
        except ValueError as exc:
            raise APIError(str(exc), param_of(str(exc))) from None
