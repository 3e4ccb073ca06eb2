"""The load-time check of the V4.1 renderer against a checkpoint's own test vectors.

The released checkpoint's ``encoding/tests/`` holds ``test_input_N.json`` (a case: ``{"messages", "tools"?,
"context"?, "thinking_mode"?, "reasoning_effort"?}``, a list of cases, or a bare list of messages; ``tools``
belong to the first message) and ``test_output_N.txt`` (the prompt the checkpoint's encoder writes).  DeepInfer
renders each case with its own renderer (it never runs the checkpoint's Python) and compares.  A case without
``thinking_mode`` is compared in chat mode, the reference test's default, and in thinking mode, so either is
accepted.  Any difference refuses chat for that checkpoint, with a message saying where the texts part.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from deepinfer.chat import deepseek_v41 as v41
from deepinfer.chat.messages import ROLES, ChatError, check_messages

logger = logging.getLogger(__name__)

_ROLES = (*ROLES, "latest_reminder")


def check_checkpoint_vectors(checkpoint: Path) -> str | None:
    """None when ``checkpoint/encoding/tests`` is absent or every vector matches; else why chat is refused."""
    folder = checkpoint / "encoding" / "tests"
    if not folder.is_dir():
        return None
    problem, checked = check_vectors(folder)
    if problem is None:
        logger.info("chat format deepseek_v41: DeepInfer's renderer matches the checkpoint's %d test vectors "
                    "(%s)", checked, folder)
        return None
    refusal = (f"chat is refused for this checkpoint: {problem}; DeepInfer renders V4.1 prompts with its own code "
               "and never runs the checkpoint's encoding.py, so a prompt it would write may differ from the "
               "model's format (pass a Jinja --chat-template / chat_template to chat anyway)")
    logger.warning("%s", refusal)
    return refusal


def check_vectors(folder: Path) -> tuple[str | None, int]:
    """(the first disagreement or None, vectors compared) for the ``test_input_N`` / ``test_output_N`` pairs."""
    checked = 0
    for source in sorted(folder.glob("test_input_*.json")):
        expected_path = folder / f"test_output_{source.stem.removeprefix('test_input_')}.txt"
        if not expected_path.is_file():
            continue
        expected = expected_path.read_text(encoding="utf-8")
        try:
            renders = [_render_case(case) for case in _cases(json.loads(source.read_text(encoding="utf-8")))]
        except (ChatError, ValueError, KeyError, TypeError) as exc:
            return f"{source.name} could not be rendered ({type(exc).__name__}: {exc})", checked
        if not any("".join(texts) == expected for texts in _choices(renders)):
            return f"{expected_path.name} {_difference(expected, renders[0][0] if len(renders) == 1 else '')}", checked
        checked += 1
    return None, checked


def _cases(data: Any) -> list[dict[str, Any]]:
    """The cases of one input file (its three shapes, as the reference encoder reads them)."""
    if isinstance(data, dict):
        data = [data]
    elif data and isinstance(data[0], dict) and "role" in data[0]:
        data = [{"messages": data}]
    cases = []
    for case in data:
        messages = [dict(m) for m in case["messages"]]
        if "tools" in case:
            messages[0]["tools"] = case["tools"]
        cases.append({**case, "messages": messages})
    return cases


def _render_case(case: dict[str, Any]) -> list[str]:
    """The case's prompt in its thinking mode, or in chat then thinking mode when it names none."""
    modes = [case["thinking_mode"]] if case.get("thinking_mode") else ["chat", "thinking"]
    messages = check_messages(case["messages"], "\n\n", _ROLES)
    context = check_messages(case["context"], "\n\n", _ROLES) if case.get("context") else None
    return [v41.encode(messages, thinking=mode == "thinking", effort=case.get("reasoning_effort"), context=context)
            for mode in modes]


def _choices(renders: list[list[str]]) -> list[list[str]]:
    """Every combination of the cases' candidate prompts (one per case)."""
    combos: list[list[str]] = [[]]
    for options in renders:
        combos = [c + [o] for c in combos for o in options]
    return combos


def _difference(expected: str, rendered: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(expected, rendered, strict=False)) if a != b),
              min(len(expected), len(rendered)))
    return (f"differs from the renderer's prompt at character {at}: expected {expected[max(0, at - 20):at + 40]!r}, "
            f"rendered {rendered[max(0, at - 20):at + 40]!r}")
