"""What every route handler needs: the async engine, the served model's name, the chat template, the limits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
