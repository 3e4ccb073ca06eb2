"""``deepinfer serve``'s chat flags (vLLM's names) and the vLLM flags it accepts without effect.

Chat: ``--chat-template`` (a Jinja file, or template text; a value that is neither is an error),
``--tokenizer-mode deepseek_v41`` (the V4.1 format even when a Jinja template exists), ``--reasoning-parser`` and
``--tool-call-parser`` (default: the chat format's own, ``deepseek_v41`` for V4.1), ``--enable-auto-tool-choice``
(on by itself when the tool parser is the format's), ``--default-chat-template-kwargs`` (JSON).
No effect, with a note: ``--tensor-parallel-size 1``, ``--trust-remote-code``, ``--disable-log-requests``,
``--enable-chunked-prefill``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from deepinfer.chat.parsers import REASONING_PARSERS, TOOL_PARSERS
from deepinfer.chat.template import DeepseekV41Format
from deepinfer.engine.unsupported import NOT_BUILT

logger = logging.getLogger(__name__)

_NOTES = {
    "trust_remote_code": NOT_BUILT["trust_remote_code"].instead,
    "disable_log_requests": "request contents are never logged",
    "enable_chunked_prefill": NOT_BUILT["enable_chunked_prefill"].instead,
}


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template: a file, or the template text itself (it contains '{{' or '{%%'); "
                        "default: the tokenizer's, else the DeepSeek-V4.1 format for V4.1 checkpoints, else a "
                        "plain transcript")
    p.add_argument("--tokenizer-mode", choices=["auto", "deepseek_v41"], default="auto",
                   help="deepseek_v41: render chats in the DeepSeek-V4.1 format even if a Jinja template exists")
    p.add_argument("--reasoning-parser", choices=[*REASONING_PARSERS, "none"], default=None,
                   help="split replies' <think> part into reasoning_content (default: the chat format's)")
    p.add_argument("--tool-call-parser", choices=[*TOOL_PARSERS, "none"], default=None,
                   help="read replies' tool calls into tool_calls (default: the chat format's)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice 'auto' (on by default where the tool parser is the chat format's)")
    p.add_argument("--default-chat-template-kwargs", type=json.loads, default=None, metavar="JSON",
                   help='chat_template_kwargs every request starts from, e.g. \'{"thinking": true}\'')


def add_noop_args(p: argparse.ArgumentParser) -> None:
    """vLLM serve flags that ask for what DeepInfer does anyway."""
    group = p.add_argument_group("vLLM flags accepted without effect")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="only 1 (docs/parallel.md)")
    for flag in ("--trust-remote-code", "--disable-log-requests", "--enable-chunked-prefill"):
        group.add_argument(flag, action="store_true", help="no effect")


def check_noop_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse ``--tensor-parallel-size`` other than 1; log a note for each no-op flag given."""
    if args.tensor_parallel_size != 1:
        parser.error(f"--tensor-parallel-size {args.tensor_parallel_size}: "
                     f"{NOT_BUILT['tensor_parallel_size'].instead}")
    for name, note in _NOTES.items():
        if getattr(args, name):
            logger.info("--%s has no effect: %s", name.replace("_", "-"), note)


def chat_template_arg(value: str | None) -> str | None:
    """``--chat-template``: a file's contents, or template text; a value that is neither is an error."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not template text (it has no '{{{{' or '{{%')")


def chat_settings(args: argparse.Namespace, llm: Any) -> dict[str, Any]:
    """The chat fields of ``ServerState`` from the flags and the engine's chat format."""
    template = chat_template_arg(args.chat_template)
    forced = DeepseekV41Format(refusal=getattr(llm.chat_format, "refusal", None)) \
        if args.tokenizer_mode == "deepseek_v41" else None
    chat_format = forced or (None if template is not None else llm.chat_format)
    own_reasoning = chat_format.reasoning_parser if chat_format is not None else None
    own_tools = chat_format.tool_parser if chat_format is not None else None
    reasoning = own_reasoning if args.reasoning_parser is None else args.reasoning_parser
    tools = own_tools if args.tool_call_parser is None else args.tool_call_parser
    tools = None if tools == "none" else tools
    kwargs = args.default_chat_template_kwargs or {}
    if not isinstance(kwargs, dict):
        raise ValueError("--default-chat-template-kwargs must be a JSON object")
    return {"chat_template": template, "forced_format": forced,
            "reasoning_parser": None if reasoning == "none" else reasoning, "tool_parser": tools,
            "auto_tool_choice": tools is not None and (args.enable_auto_tool_choice or tools == own_tools),
            "default_chat_template_kwargs": kwargs}
