"""Which chat format renders a model's conversations, and the prompt it makes.

In order: a Jinja template given by the caller (``--chat-template``, ``LLM.chat(chat_template=...)``); the
tokenizer's own (``tokenizer_config.json`` / ``chat_template.jinja``); for a ``deepseek_v41`` checkpoint, which
ships none, the V4.1 format (:mod:`deepinfer.chat.deepseek_v41`, checked against the checkpoint's
``encoding/tests`` vectors when it has them); else :data:`FALLBACK_CHAT_TEMPLATE`, a plain ``User:`` /
``Assistant:`` transcript.  A format names the reasoning and tool parsers that read its replies.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from deepinfer.chat import deepseek_v41 as v41
from deepinfer.chat.messages import ChatError, check_messages, check_tools

logger = logging.getLogger(__name__)

#: A plain transcript for tokenizers that ship no template: system text, then ``User:`` / ``Assistant:`` turns.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
#: ``model_type`` values whose checkpoints speak the V4.1 format.
V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")


class ChatFormat(Protocol):
    """Renders a conversation (OpenAI messages, tools, ``chat_template_kwargs``) into prompt text."""

    name: str
    #: Parsers (``deepinfer.chat.parsers``) for this format's replies; None where it has none.
    reasoning_parser: str | None
    tool_parser: str | None

    def render(self, messages: Any, tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
               options: Mapping[str, Any]) -> str: ...


@dataclass(slots=True)
class JinjaFormat:
    """A Jinja chat template, rendered by the tokenizer (transformers' ``apply_chat_template``)."""

    tokenizer: Any
    template: str
    name: str = "jinja"
    reasoning_parser: str | None = None
    tool_parser: str | None = None

    def render(self, messages: Any, tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
               options: Mapping[str, Any]) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                check_messages(messages), chat_template=self.template, tokenize=False, tools=check_tools(tools) or None,
                add_generation_prompt=add_generation_prompt, **dict(options))
        except ChatError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error (jinja) names what the conversation lacks
            raise ChatError(f"the chat template could not render these messages ({type(exc).__name__}: {exc})"
                            ) from None
        if not isinstance(text, str):
            raise ChatError(f"the chat template rendered {type(text).__name__}, not text")
        return text


@dataclass(slots=True)
class DeepseekV41Format:
    """The V4.1 format.  ``options`` (``chat_template_kwargs``): ``thinking`` (alias ``enable_thinking``),
    ``reasoning_effort``, ``drop_thinking``.  ``refusal``: why chat is refused (vectors that disagree)."""

    name: str = "deepseek_v41"
    reasoning_parser: str | None = "deepseek_v41"
    tool_parser: str | None = "deepseek_v41"
    refusal: str | None = None

    def render(self, messages: Any, tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
               options: Mapping[str, Any]) -> str:
        if self.refusal is not None:
            raise ChatError(self.refusal)
        thinking, effort = thinking_options(options)
        checked = check_messages(messages, separator="\n\n")
        if tools:  # on the first system message, made empty if there is none (as vLLM's deepseek_v41 mode)
            system = next((m for m in checked if m["role"] == "system"), None)
            if system is None:
                system = {"role": "system", "content": ""}
                checked.insert(0, system)
            system["tools"] = check_tools(tools)
        drop = options.get("drop_thinking", True)
        if not isinstance(drop, bool):
            raise ChatError(f"chat_template_kwargs.drop_thinking must be a bool, got {drop!r}")
        return v41.encode(checked, thinking=thinking, effort=effort, drop_thinking=drop,
                          add_generation_prompt=add_generation_prompt)


def thinking_options(options: Mapping[str, Any]) -> tuple[bool, Any]:
    """(thinking on?, effort) from ``thinking`` / ``enable_thinking`` / ``reasoning_effort``.  Thinking is off
    unless asked for; a ``reasoning_effort`` other than ``"none"`` asks for it (``"none"`` turns it off)."""
    thinking = options.get("thinking", options.get("enable_thinking"))
    if thinking is not None and not isinstance(thinking, bool):
        raise ChatError(f"chat_template_kwargs.thinking must be a bool, got {thinking!r}")
    effort = options.get("reasoning_effort")
    if effort == "none":
        return False, None
    if effort is not None:
        v41.effort_budget(effort)  # a bad value fails even when thinking is off
    return (effort is not None) if thinking is None else thinking, effort


def select_chat_format(tokenizer: Any, model_type: str | None, template: str | None = None,
                       checkpoint: Path | None = None) -> ChatFormat:
    """The format for a model (module docstring); a V4.1 checkpoint's vectors are checked here."""
    if template is not None:
        return JinjaFormat(tokenizer, template)
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, str) and own:
        return JinjaFormat(tokenizer, own)
    if model_type in V41_MODEL_TYPES:
        from deepinfer.chat.vectors import check_checkpoint_vectors

        return DeepseekV41Format(refusal=check_checkpoint_vectors(checkpoint) if checkpoint is not None else None)
    return JinjaFormat(tokenizer, FALLBACK_CHAT_TEMPLATE, name="fallback")


def render_prompt(tokenizer: Any, chat_format: ChatFormat, messages: Any, tools: list[dict[str, Any]] | None = None,
                  add_generation_prompt: bool = True, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A tokens prompt (``{"prompt": text, "prompt_token_ids": ids}``) for one conversation; a rendered BOS is not
    doubled by the tokenizer's own."""
    if tokenizer is None:
        raise ChatError("chat needs a tokenizer (the engine has none)")
    text = chat_format.render(messages, tools, add_generation_prompt, options or {})
    bos = getattr(tokenizer, "bos_token", None)
    has_bos = isinstance(bos, str) and bool(bos) and text.startswith(bos)
    ids = tokenizer.encode(text, add_special_tokens=not has_bos)
    return {"prompt": text, "prompt_token_ids": list(ids)}
