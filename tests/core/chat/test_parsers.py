"""The reasoning and DSML tool parsers (``deepinfer/chat/{reasoning,tool_parser,parsers}.py``): whole replies, the
same replies streamed piece by piece (characters, tokens, random cuts), DSML opened inside ``<think>``, and
malformed DSML, which comes back as text."""

from __future__ import annotations

import random

import pytest

from deepinfer.chat import ReplyDelta, ReplyParser, ToolCall
from deepinfer.chat.dsml import encode_calls

V41 = "deepseek_v41"
THINKING, CHAT = "...<｜Assistant｜><think>", "...<｜Assistant｜></think>"
WEATHER = encode_calls([("get_weather", {"city": "Paris", "days": 3})])
TWO = encode_calls([("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET", "utc": False})])
PARIS, ZONE = ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", '{"zone": "CET", "utc": false}')


def streamed(text: str, pieces: list[str], prompt: str, reasoning: str | None = V41,
             tools: str | None = V41) -> ReplyDelta:
    assert "".join(pieces) == text
    parser, total = ReplyParser(reasoning, tools, prompt), ReplyDelta()
    for piece in pieces:
        total.add(parser.feed(piece))
    total.add(parser.finish())
    return total


def cuts(text: str) -> list[list[str]]:
    """Characters, whole, and three random cuttings."""
    out = [list(text), [text]]
    for seed in range(3):
        rng = random.Random(seed)
        points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    return out


CASES = [
    # (prompt, reply, reasoning, content, calls)
    (THINKING, "Let me see.</think>It is sunny.", "Let me see.", "It is sunny.", []),
    (CHAT, "It is sunny.", "", "It is sunny.", []),
    (CHAT, "<think>odd</think>ok", "odd", "ok", []),  # a reply that opens its own reasoning
    (THINKING, "still thinking when cut off", "still thinking when cut off", "", []),
    (THINKING, "Need tools.</think>Checking." + WEATHER, "Need tools.", "Checking.",
     [ToolCall("get_weather", '{"city": "Paris", "days": 3}')]),
    (CHAT, TWO, "", "", [PARIS, ZONE]),
    (THINKING, "I will call it" + TWO, "I will call it", "", [PARIS, ZONE]),  # DSML opened inside <think>
    (CHAT, "Before" + TWO + "\nafter", "", "Before\nafter", [PARIS, ZONE]),
    (CHAT, "a < b and </think> is text here\n\n", "", "a < b and </think> is text here\n\n", []),
]


@pytest.mark.parametrize(("prompt", "reply", "reasoning", "content", "calls"), CASES)
def test_whole_and_streamed_agree(prompt, reply, reasoning, content, calls):
    whole = ReplyParser.parse(reply, V41, V41, prompt)
    assert whole == ReplyDelta(reasoning, content, calls)
    for pieces in cuts(reply):
        assert streamed(reply, pieces, prompt) == whole, pieces


def test_token_by_token():
    """The pieces the engine's detokenizer hands out, one token at a time (a multi-byte character waits)."""
    from deepinfer.engine.detokenizer import IncrementalDetokenizer
    from tests.support.toy_model import toy_tokenizer

    tok = toy_tokenizer()
    reply = "Some thought.</think>Answer." + TWO
    detok = IncrementalDetokenizer(tok, [0], skip_special_tokens=False)
    pieces = [detok.add(t) for t in tok.encode(reply, add_special_tokens=False)]
    assert streamed(reply, pieces, THINKING) == ReplyDelta("Some thought.", "Answer.", [PARIS, ZONE])


MALFORMED = [
    WEATHER.replace('string="false">3', 'string="false">three'),  # not JSON
    WEATHER.replace('<｜DSML｜ parameter name="days"', 'junk <｜DSML｜ parameter name="days"'),  # text between tags
    WEATHER.replace('name="days"', 'name="city"'),  # a parameter twice
    WEATHER.replace("<｜DSML｜ invoke", "<｜DSML｜ oops"),  # not an invoke
    WEATHER[:-20],  # cut off before the block closes
]


@pytest.mark.parametrize("block", MALFORMED)
def test_malformed_dsml_comes_back_as_text(block):
    reply = "Here." + block
    whole = ReplyParser.parse(reply, V41, V41, CHAT)
    assert whole == ReplyDelta("", reply, [])
    for pieces in cuts(reply):
        assert streamed(reply, pieces, CHAT) == whole


def test_calls_before_a_malformed_one_are_kept_the_rest_is_text():
    good = encode_calls([("get_weather", {"city": "Paris"})])
    reply = TWO.replace('name="utc" string="false">false', 'name="utc" string="false">nope')
    whole = ReplyParser.parse(reply, V41, V41, CHAT)
    assert whole.tool_calls == [PARIS] and whole.content.startswith("\n<｜DSML｜ invoke name=\"get_time\">")
    assert whole.content.endswith("</｜DSML｜ calls>") and reply.startswith(good[:-len("\n</｜DSML｜ calls>")])
    for pieces in cuts(reply):
        assert streamed(reply, pieces, CHAT) == whole


def test_without_a_tool_parser_dsml_is_content_and_without_reasoning_parser_think_is_too():
    assert ReplyParser.parse("x" + WEATHER, V41, None, CHAT) == ReplyDelta("", "x" + WEATHER, [])
    assert ReplyParser.parse("r</think>c", None, None, THINKING) == ReplyDelta("", "r</think>c", [])
    with pytest.raises(ValueError, match="unknown tool parser"):
        ReplyParser(None, "hermes", CHAT)


def test_streamed_calls_come_as_each_invoke_closes():
    parser = ReplyParser(V41, V41, CHAT)
    first_close = TWO.index("</｜DSML｜ invoke>") + len("</｜DSML｜ invoke>")
    assert parser.feed(TWO[:first_close]).tool_calls == [PARIS]
    assert parser.feed(TWO[first_close:]).tool_calls == [ZONE]
    assert not parser.finish()
