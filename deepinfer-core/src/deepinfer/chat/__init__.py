"""Chat: conversations rendered into prompts, and replies read back into reasoning, content and tool calls.

``template`` picks a model's chat format (a Jinja template, else the DeepSeek-V4.1 format for V4.1 checkpoints,
else a plain transcript); ``deepseek_v41`` is the V4.1 renderer and ``vectors`` its load-time check against a
checkpoint's test vectors; ``dsml`` the tool-call markup; ``reasoning`` / ``tool_parser`` the reply parsers and
``parsers`` their registry; ``tool_grammar`` the grammar that enforces ``tool_choice``.  ``LLM.chat`` and the
OpenAI server (``deepinfer.entrypoints.openai``) use them.  See ``docs/serving.md``.
"""

from deepinfer.chat.dsml import ToolCall
from deepinfer.chat.messages import ChatError, check_messages
from deepinfer.chat.parsers import ReplyDelta, ReplyParser
from deepinfer.chat.template import (
    FALLBACK_CHAT_TEMPLATE,
    ChatFormat,
    DeepseekV41Format,
    JinjaFormat,
    render_prompt,
    select_chat_format,
)
from deepinfer.chat.tool_grammar import tool_call_grammar

__all__ = [
    "FALLBACK_CHAT_TEMPLATE",
    "ChatError",
    "ChatFormat",
    "DeepseekV41Format",
    "JinjaFormat",
    "ReplyDelta",
    "ReplyParser",
    "ToolCall",
    "check_messages",
    "render_prompt",
    "select_chat_format",
    "tool_call_grammar",
]
