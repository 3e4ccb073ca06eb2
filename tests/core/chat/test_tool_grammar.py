"""``tool_choice`` enforcement (``deepinfer/chat/tool_grammar.py``): the grammar admits exactly DSML blocks that call
the allowed functions with their declared parameters, and the engine's structured output makes even a random
model write one that the tool parser reads back."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from deepinfer import LLM, SamplingParams
from deepinfer.chat import ReplyParser, tool_call_grammar
from deepinfer.chat.dsml import encode_calls
from deepinfer.structured import GrammarCompiler
from tests.support.toy_model import ToyCausalLM, toy_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "ping"}},
    {"type": "function", "function": {"name": "switch", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}},
]


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


def accepts(tokenizer, grammar: str, text: str) -> bool:
    matcher = xgr.GrammarMatcher(GrammarCompiler(tokenizer, len(tokenizer)).compile({"ebnf": grammar}))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(("kwargs", "calls", "ok"), [
    ({}, [("get_weather", {"city": "Paris", "days": 2})], True),
    ({}, [("get_weather", {"city": "Paris"}), ("ping", {"any": [1, {"x": None}]})], True),
    ({}, [("ping", {})], True),
    ({}, [("get_weather", {"days": 2})], False),  # a required parameter missing
    ({}, [("get_weather", {"city": "Paris", "extra": 1})], False),  # an undeclared one
    ({}, [("get_weather", {"city": 3})], False),  # a string parameter written as JSON
    ({}, [("get_weather", {"city": "Oslo", "days": 1, "unit": "C"})], True),
    ({}, [("get_weather", {"city": "Oslo", "unit": "K"})], False),  # not one of the enum's values
    ({}, [("get_weather", {"city": "Oslo", "days": 1.5})], False),  # not an integer
    ({}, [("unknown", {})], False),
    ({"name": "ping"}, [("ping", {})], True),
    ({"name": "ping"}, [("switch", {"on": True})], False),
    ({"parallel": False}, [("ping", {}), ("ping", {})], False),
])
def test_the_grammar_admits_the_allowed_calls_only(tokenizer, kwargs, calls, ok):
    assert accepts(tokenizer, tool_call_grammar(TOOLS, **kwargs), encode_calls(calls)) is ok


def test_reasoning_first_then_the_block(tokenizer):
    grammar = tool_call_grammar(TOOLS, reasoning_first=True)
    block = encode_calls([("ping", {})])
    assert accepts(tokenizer, grammar, "Think a < b.</think>" + block)
    assert not accepts(tokenizer, grammar, block)  # the reasoning must be closed first


def test_a_named_function_that_is_not_a_tool_is_refused():
    with pytest.raises(ValueError, match="tool_choice names function 'nope'"):
        tool_call_grammar(TOOLS, name="nope")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_model_is_made_to_call_a_tool(tokenizer, seed):
    model = ToyCausalLM(len(tokenizer), seed=seed)
    model.config.model_type = "deepseek_v41"  # the V4.1 chat format and its parsers
    llm = LLM.from_model(model, tokenizer, max_num_seqs=2)
    tools = TOOLS[1:]  # ping (any parameters: bounded by max_tokens) and switch (one boolean)
    grammar = tool_call_grammar(tools, name="switch", parallel=False)
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200, so_args={"ebnf": grammar})
    (out,) = llm.chat([{"role": "user", "content": "Turn it on."}], params, tools=tools, use_tqdm=False)
    assert out.error is None and out.outputs[0].finish_reason == "stop", out
    reply = ReplyParser.parse(out.outputs[0].text, "deepseek_v41", "deepseek_v41", out.prompt or "")
    assert reply.content == "" and [c.name for c in reply.tool_calls] == ["switch"], reply
    assert json.loads(reply.tool_calls[0].arguments) in ({"on": True}, {"on": False})
