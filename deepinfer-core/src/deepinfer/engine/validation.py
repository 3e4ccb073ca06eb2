"""Per-request checks: a bad request is rejected alone, with a message that says what to fix."""

from __future__ import annotations

from typing import Any

from deepinfer.engine.config import EngineConfig
from deepinfer.models.base import CausalLM
from deepinfer.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request that cannot run; the message names the field and the allowed range."""


#: The keys a prompt dict may have (vLLM's ``TextPrompt`` / ``TokensPrompt``); a tokens prompt may carry its text.
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def normalize_prompt(prompt: Any, tokenizer: Any) -> tuple[str | None, list[int]]:
    """``(text, token ids)`` of a prompt given as text, token ids, or a ``{"prompt": str}`` /
    ``{"prompt_token_ids": list[int]}`` dict.  ``RequestError`` for anything else, naming what is wrong."""
    if isinstance(prompt, dict):
        return _prompt_dict(prompt, tokenizer)
    if isinstance(prompt, str):
        return prompt, _encode(prompt, tokenizer)
    if isinstance(prompt, (list, tuple)):
        return None, token_ids(prompt, "prompt")
    raise RequestError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _prompt_dict(prompt: dict[Any, Any], tokenizer: Any) -> tuple[str | None, list[int]]:
    unknown = sorted(repr(k) if not isinstance(k, str) else k for k in prompt if k not in PROMPT_KEYS)
    if unknown:
        raise RequestError(f"prompt dict has unknown key(s) {unknown}; it takes 'prompt' (text) or "
                           "'prompt_token_ids' (a list of token ids)")
    if not prompt:
        raise RequestError("a prompt dict needs a 'prompt' (text) or 'prompt_token_ids' key")
    text = prompt.get("prompt")
    if "prompt" in prompt and not isinstance(text, str):
        raise RequestError(f"prompt dict: 'prompt' must be a string (the text), got {_describe(text)}; "
                           "token ids go in 'prompt_token_ids'")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise RequestError(f"prompt dict: 'prompt_token_ids' must be a list of token ids, got {_describe(ids)}; "
                               "text goes in 'prompt'")
        return text, token_ids(ids, "prompt_token_ids")
    assert text is not None
    return text, _encode(text, tokenizer)


def token_ids(values: list[Any] | tuple[Any, ...], name: str) -> list[int]:
    """``values`` as a list of ints: each must be an integer (``bool`` is not a token id)."""
    bad = next((i for i, t in enumerate(values) if not isinstance(t, int) or isinstance(t, bool)), None)
    if bad is not None:
        raise RequestError(f"{name} token at index {bad} is {_describe(values[bad])}, not an integer token id")
    return [int(t) for t in values]


def _encode(text: str, tokenizer: Any) -> list[int]:
    if not text:
        raise RequestError("prompt is empty")
    if tokenizer is None:
        raise RequestError("text prompts need a tokenizer; pass token ids")
    try:
        ids = tokenizer.encode(text)
    except Exception as exc:  # noqa: BLE001 - the tokenizer's own error (e.g. TypeError on a lone surrogate)
        raise RequestError(f"the prompt text could not be encoded by the tokenizer ({type(exc).__name__}: {exc})"
                           ) from None
    return token_ids(list(ids), "encoded prompt")


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def check_prompt_length(token_ids: list[int], max_model_len: int) -> None:
    """A prompt must leave room for one generated token."""
    if len(token_ids) >= max_model_len:
        raise RequestError(
            f"prompt has {len(token_ids)} tokens; max_model_len={max_model_len} allows at most "
            f"{max_model_len - 1} so that one token can be generated"
        )


def check_request(
    token_ids: list[int], params: SamplingParams, config: EngineConfig, vocab_size: int,
    model: CausalLM, has_tokenizer: bool,
) -> None:
    """Raise ``RequestError`` when the request cannot run on this ``model``'s engine."""
    if not token_ids:
        raise RequestError("prompt is empty (it has no tokens)")
    bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"prompt token id {token_ids[bad]} at index {bad} is outside the vocabulary [0, {vocab_size})"
        )
    check_prompt_length(token_ids, config.max_model_len)
    try:
        params.validate()  # again: fields may have been changed after construction
    except ValueError as exc:
        raise RequestError(f"invalid sampling parameters: {exc}") from None
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > config.max_logprobs:
            raise RequestError(f"{name} must be in [0, max_logprobs={config.max_logprobs}], got {value}")
    bad_stop = [t for t in params.stop_token_ids or () if t >= vocab_size]
    if bad_stop:
        raise RequestError(f"stop_token_ids {bad_stop} are outside the vocabulary [0, {vocab_size})")
    if params.n > config.max_num_seqs:
        raise RequestError(f"n must be in [1, max_num_seqs={config.max_num_seqs}], got {params.n}")
    need = params.n * model.state_bytes(len(token_ids))
    if need > config.state_cache_bytes:
        enough = model.state_pool_bytes(config.max_num_seqs, len(token_ids), sequences=params.n)
        raise RequestError(
            f"n={params.n} copies of a {len(token_ids)}-token prompt need {need} bytes of model state; the state "
            f"cache holds {config.state_cache_bytes} (raise state_cache_bytes to at least {enough}, or lower n)"
        )
    if params.so_args is not None and not has_tokenizer:
        raise RequestError("so_args (structured output) needs the model's tokenizer; this LLM was built without one")
