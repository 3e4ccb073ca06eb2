"""The DeepSeek-V4.1 renderer against golden prompts, one construct each (``deepinfer/chat/deepseek_v41.py``).

Each expected string is written out from the format's rules (the released encoder's, as vLLM and SGLang implement
them): BOS once; ``<｜System｜>`` before the system prompt and the reasoning-effort line; ``<｜User｜>`` turns each
opening ``<｜Assistant｜>`` with ``<think>`` (thinking on) or ``</think>`` (off); earlier replies' reasoning dropped;
tools after the system prompt; DSML calls; tool results merged into the next user turn.
"""

from __future__ import annotations

import pytest

from deepinfer.chat import ChatError, DeepseekV41Format, render_prompt
from deepinfer.chat.deepseek_v41 import TOOLS_PROMPT

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
S, U, A = "<｜System｜>", "<｜User｜>", "<｜Assistant｜>"


def effort(n: int) -> str:
    return f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def render(messages, tools=None, add_generation_prompt=True, **options):
    return DeepseekV41Format().render(messages, tools, add_generation_prompt, options)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
SCHEMA = '{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", ' \
         '"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}'
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
BLOCK = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
         '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
         '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')


def test_one_user_turn_thinking_off_by_default():
    assert render([{"role": "user", "content": "Hi"}]) == B + U + "Hi" + A + "</think>"


def test_system_prompt_and_multi_turn():
    got = render([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Q1"},
                  {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}])
    assert got == B + S + "Be kind." + U + "Q1" + A + "</think>A1" + E + U + "Q2" + A + "</think>"


def test_thinking_on_opens_the_reasoning_with_the_default_effort():
    assert render([{"role": "user", "content": "Hi"}], thinking=True) == B + S + effort(75) + U + "Hi" + A + "<think>"
    assert render([{"role": "user", "content": "Hi"}], enable_thinking=True) == \
        render([{"role": "user", "content": "Hi"}], thinking=True)


@pytest.mark.parametrize(("value", "budget"), [("low", 50), ("medium", 62), ("high", 75), ("max", 100), (1, 1),
                                               (42, 42), (100, 100)])
def test_reasoning_effort_turns_thinking_on(value, budget):
    got = render([{"role": "system", "content": "Sys"}, {"role": "user", "content": "Hi"}], reasoning_effort=value)
    assert got == B + S + effort(budget) + "Sys" + U + "Hi" + A + "<think>"


def test_effort_none_or_thinking_false_is_chat_mode():
    plain = B + U + "Hi" + A + "</think>"
    assert render([{"role": "user", "content": "Hi"}], reasoning_effort="none") == plain
    assert render([{"role": "user", "content": "Hi"}], thinking=False, reasoning_effort="max") == plain


@pytest.mark.parametrize("value", ["minimal", "xhigh", 0, 101, True, 1.5, "75"])
def test_bad_effort_names_the_field(value):
    with pytest.raises(ChatError, match="reasoning_effort"):
        render([{"role": "user", "content": "Hi"}], reasoning_effort=value)


def test_earlier_reasoning_is_dropped_the_latest_kept():
    messages = [{"role": "user", "content": "Q1"}, {"role": "assistant", "reasoning_content": "r1", "content": "A1"},
                {"role": "user", "content": "Q2"}, {"role": "assistant", "reasoning": "r2", "content": "A2"}]
    assert render(messages, thinking=True) == (B + S + effort(75) + U + "Q1" + A + "</think>A1" + E + U + "Q2" + A
                                               + "<think>r2</think>A2" + E)
    assert render(messages) == B + U + "Q1" + A + "</think>A1" + E + U + "Q2" + A + "</think>A2" + E  # chat mode
    kept = render(messages, thinking=True, drop_thinking=False)
    assert U + "Q1" + A + "<think>r1</think>A1" + E in kept


def test_tools_follow_the_system_prompt_and_calls_are_dsml():
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    got = render(messages, tools=[WEATHER])
    assert got == B + S + "\n\n" + TOOLS_PROMPT.format(schemas=SCHEMA) + U + "Weather?" + A + "</think>" + BLOCK + E
    with_system = render([{"role": "system", "content": "Sys"}, *messages], tools=[WEATHER])
    assert with_system.startswith(B + S + "Sys\n\n## Tools\n\nYou have access to a set of tools")


def test_tool_results_join_the_next_user_turn_in_call_order():
    second = {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, second]},
                {"role": "tool", "tool_call_id": "c2", "content": "rain"},
                {"role": "tool", "tool_call_id": "c1", "content": "sun"},
                {"role": "user", "content": "Thanks"}]
    got = render(messages, thinking=True)
    rome = ('<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Rome'
            '</｜DSML｜ parameter>\n</｜DSML｜ invoke>')
    block = BLOCK.replace("\n</｜DSML｜ calls>", "\n" + rome + "\n</｜DSML｜ calls>")
    # no tools defined: earlier reasoning is dropped (none here), the reply before the last user turn has no </think>
    assert got == (B + S + effort(75) + U + "Weather?" + A + "</think>Checking." + block + E
                   + U + "<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>\n\nThanks" + A + "<think>")


def test_with_tools_thinking_keeps_every_turns_reasoning():
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "reasoning_content": "r", "content": "",
                                                   "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "sun"}]
    got = render(messages, tools=[WEATHER], thinking=True)
    assert got.endswith(U + "Q" + A + "<think>r</think>" + BLOCK + E + U + "<tool_result>sun</tool_result>" + A
                        + "<think>")


def test_mid_conversation_system_developer_and_no_generation_prompt():
    got = render([{"role": "user", "content": "Q"}, {"role": "system", "content": "Be brief."}])
    assert got == B + U + "Q" + S + "Be brief." + A + "</think>"
    assert render([{"role": "developer", "content": "Dev"}, {"role": "user", "content": "Q"}]) == \
        B + U + "Dev" + U + "Q" + A + "</think>"
    assert render([{"role": "user", "content": "Q"}], add_generation_prompt=False) == B + U + "Q"


def test_text_parts_join_with_a_blank_line():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert render([{"role": "user", "content": parts}]) == B + U + "first\n\nsecond" + A + "</think>"
    with pytest.raises(ChatError, match="text parts"):
        render([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_bos_once_in_the_tokens():
    from tests.support.toy_model import toy_tokenizer

    tok = toy_tokenizer()
    tok.bos_token = B  # the toy's BOS spelled as V4.1's, so the rendered prompt starts with it
    prompt = render_prompt(tok, DeepseekV41Format(), [{"role": "user", "content": "Hi"}])
    assert prompt["prompt"].count(B) == 1
    assert prompt["prompt_token_ids"] == tok.encode(prompt["prompt"], add_special_tokens=False)


def test_refused_format_says_why():
    with pytest.raises(ChatError, match="vectors disagree"):
        DeepseekV41Format(refusal="vectors disagree").render([{"role": "user", "content": "x"}], None, True, {})
