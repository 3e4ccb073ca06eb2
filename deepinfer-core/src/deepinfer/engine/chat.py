"""Chat prompts: a conversation rendered by the tokenizer's chat template into one prompt.

The template is the tokenizer's (``tokenizer_config.json`` / ``chat_template.jinja``); a tokenizer without one
(the embedded toy models) gets :data:`FALLBACK_CHAT_TEMPLATE`, a plain ``User:`` / ``Assistant:`` transcript.
A rendered prompt that already starts with the BOS token is tokenized without adding special tokens, so BOS
is not doubled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: A plain transcript for tokenizers that ship no template: system text, then ``User:`` / ``Assistant:`` turns.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

_ROLES = ("system", "user", "assistant", "developer", "tool")


class ChatError(ValueError):
    """A conversation that cannot be rendered; the message names the message index and field."""


def chat_template(tokenizer: Any, template: str | None = None) -> str:
    """``template`` if given, else the tokenizer's, else :data:`FALLBACK_CHAT_TEMPLATE`."""
    if template is not None:
        return template
    own = getattr(tokenizer, "chat_template", None)
    return own if isinstance(own, str) and own else FALLBACK_CHAT_TEMPLATE


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as plain dicts with string content; text parts of a list content are joined."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ChatError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in _ROLES:
            raise ChatError(f"messages[{i}].role must be one of {list(_ROLES)}, got {role!r}")
        checked.append({**message, "content": _content(message.get("content"), i)})
    return checked


def _content(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': str}}) are "
                                f"supported, got {part!r:.80}")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatError(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}")


def render_chat(tokenizer: Any, messages: Any, template: str | None = None, add_generation_prompt: bool = True,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A tokens prompt (``{"prompt": text, "prompt_token_ids": ids}``) for one conversation."""
    if tokenizer is None:
        raise ChatError("chat needs a tokenizer (the engine has none)")
    try:
        text = tokenizer.apply_chat_template(
            check_messages(messages), chat_template=chat_template(tokenizer, template), tokenize=False,
            add_generation_prompt=add_generation_prompt, **dict(chat_template_kwargs or {}))
    except ChatError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template error (jinja) names what the conversation lacks
        raise ChatError(f"the chat template could not render these messages ({type(exc).__name__}: {exc})") from None
    if not isinstance(text, str):
        raise ChatError(f"the chat template rendered {type(text).__name__}, not text")
    bos = getattr(tokenizer, "bos_token", None)
    has_bos = isinstance(bos, str) and bool(bos) and text.startswith(bos)
    ids = tokenizer.encode(text, add_special_tokens=not has_bos)
    return {"prompt": text, "prompt_token_ids": list(ids)}
