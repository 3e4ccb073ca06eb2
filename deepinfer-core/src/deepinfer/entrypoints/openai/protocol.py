"""Request bodies of the OpenAI-compatible API (pydantic models), and their translation to ``SamplingParams``.

Unknown fields are refused (400 naming the field) rather than ignored, so a typo or a feature DeepInfer does not
have never passes silently.  OpenAI fields DeepInfer does not support are declared and refused when set to
anything but their "off" value (``docs/serving.md`` lists them).  vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ...) and DeepInfer's ``so_args``
are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.sampling_params import RequestOutputKind, SamplingParams

# (imports xgrammar, a C extension taking ~0.7 s: at server start, not on the event loop at the first request)
from deepinfer.structured.vllm_names import StructuredOutputsError, request_so_args


class RequestFieldError(ValueError):
    """A request field with a value DeepInfer refuses: becomes a 400 naming ``param``."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    """Unknown fields refused, and types as strict as the offline ``SamplingParams``: no bool as a number
    (``"n": true``), no text as a number (``"max_tokens": "16"``), no float as an int (``"n": 2.0``); an int is
    a float (``"temperature": 1``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Strict):
    """Fields both endpoints share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # DeepInfer's structured output: {"regex": ...} | {"json_schema": ...} | {"ebnf": ...}
    so_args: dict[str, Any] | None = None
    # vLLM's structured-output names (deepinfer.structured.vllm_names)
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    def _so_args(self) -> dict[str, Any] | None:
        try:
            given = request_so_args(self)
        except StructuredOutputsError as exc:
            raise RequestFieldError(exc.field, str(exc)) from None
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return given
        if given is not None:
            raise RequestFieldError("response_format", "give response_format or one structured-output field "
                                    "(so_args, structured_outputs, guided_*), not both")
        if fmt.type == "json_object":
            return {"json_schema": {"type": "object"}}
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise RequestFieldError("response_format.json_schema",
                                    "response_format of type 'json_schema' needs json_schema.schema")
        return {"json_schema": fmt.json_schema.schema_}

    def _refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise RequestFieldError("logit_bias", "logit_bias is not supported yet")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's parameters (``RequestFieldError`` / ``ValueError`` naming the field when invalid)."""
        self._refuse_unsupported()
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop or None, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            seed=self.seed, so_args=self._so_args(),
            skip_special_tokens=self.skip_special_tokens, output_kind=RequestOutputKind.DELTA,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    #: Token ids are tried before texts and refused on their first non-int: a smart union would validate a
    #: million-id prompt against every form (seconds on the event loop).
    prompt: str | list[int] | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's extension: top-k logprobs of every prompt token (echo with logprobs gives them too)
    prompt_logprobs: int | None = None

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        if self.suffix:
            raise RequestFieldError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestFieldError("best_of", f"best_of must equal n ({self.n}) or be omitted; ranking "
                                    "completions by likelihood is not supported")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):  # one text or one list of token ids (a
            return [p]  # validated list has one element type)
        if not p:
            raise RequestFieldError("prompt", "prompt must not be empty")
        return list(p)  # type: ignore[arg-type]  # a list of texts or of token-id lists


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | int | None = None
    # vLLM's extensions
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestFieldError("top_logprobs", "top_logprobs needs logprobs: true")

    def output_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise RequestFieldError("max_completion_tokens", "give max_completion_tokens or max_tokens, not both")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
