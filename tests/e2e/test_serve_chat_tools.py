"""``deepinfer serve`` speaking DeepSeek-V4.1 to the ``openai`` client: tool calls (``tools``, ``tool_choice``),
``reasoning_content``, and the vLLM extras (``echo`` with prompt logprobs, ``/tokenize``, ``/detokenize``,
``structured_outputs``, OpenAI-shaped 404 / 501).

The model's replies are scripted: a request's ``so_args`` grammar admits one string only, so the embedded model
writes exactly that text (a DSML tool call, a reasoning), and the server's parsers read it back.
"""

from __future__ import annotations

import json

import httpx
import pytest

from deepinfer.chat.dsml import encode_calls
from tests.support.tiny_assets import known_words

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
CALL = encode_calls([("get_weather", {"city": "Paris", "days": 2})])


def scripted(text: str) -> dict:
    """extra_body making the model write ``text`` (and then stop)."""
    return {"so_args": {"ebnf": "root ::= " + json.dumps(text, ensure_ascii=False)}}


@pytest.fixture(scope="module")
def client(server_url):
    with openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", timeout=120, max_retries=0) as c:
        yield c


def test_tools_round_trip(client, server_url):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER], max_tokens=200,
                                         extra_body=scripted("Let me check." + CALL))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    # the call and its result go back into the conversation, rendered as the format does
    history = [*ask, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    prompt = httpx.post(f"{server_url}/tokenize", json={"messages": history, "tools": [WEATHER]}, timeout=60).json()
    text = httpx.post(f"{server_url}/detokenize", json={"tokens": prompt["tokens"]}, timeout=60).json()["prompt"]
    assert CALL + "<｜end▁of▁sentence｜><｜User｜><tool_result>Sunny, 24 C</tool_result><｜Assistant｜></think>" in text
    final = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=60,
                                           extra_body=scripted("It is sunny in Paris."))
    assert final.choices[0].message.content == "It is sunny in Paris." and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "stop" and final.usage.prompt_tokens == prompt["count"]


def test_streamed_tool_calls_add_up_to_the_whole(client):
    """The stream's deltas add up to the scripted reply (the whole reply's parse: ``test_tools_round_trip``)."""
    wanted = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 1})]
    chunks = [c.choices[0] for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Paris and Oslo?"}], tools=[WEATHER], max_tokens=600,
        stream=True, extra_body=scripted("Checking both." + encode_calls(wanted))) if c.choices]
    content = "".join(c.delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in c.delta.tool_calls or []]
    assert content == "Checking both." and chunks[-1].finish_reason == "tool_calls"
    assert [t.index for t in calls] == [0, 1]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == wanted


def test_tool_choice_none_leaves_dsml_as_text(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                         tools=[WEATHER], tool_choice="none", max_tokens=400, extra_body=scripted(CALL))
    assert out.choices[0].message.content == CALL and not out.choices[0].message.tool_calls


@pytest.mark.parametrize("tool_choice", [  # ~6 s each: the named choice is slow (its sibling: "required")
    "required", pytest.param({"type": "function", "function": {"name": "get_weather"}}, marks=pytest.mark.slow)])
def test_tool_choice_required_or_named_is_enforced(client, tool_choice):
    """The toy never saw a tool call, yet it writes one: the grammar leaves it only the choice of the city (an enum,
    so a story cannot run on inside a free string parameter) and of the days."""
    cities = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "boolean"}}, "required": ["city", "days"]}}}
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}],
                                         tools=[cities], tool_choice=tool_choice, max_tokens=200, temperature=0,
                                         parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Oslo")
    assert isinstance(arguments["days"], bool) and choice.message.content is None


def test_reasoning_content_streams_apart_from_the_content(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], reasoning_effort="low",
                  max_tokens=100, extra_body=scripted("A short one.</think>Once upon a time, there was a cat."))
    whole = client.chat.completions.create(**kwargs).choices[0].message
    assert whole.reasoning_content == "A short one." and whole.content == "Once upon a time, there was a cat."
    chunks = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    reasoning = [d.reasoning_content for d in chunks if getattr(d, "reasoning_content", None)]
    assert "".join(reasoning) == whole.reasoning_content and len(reasoning) > 1  # streamed, not one blob
    assert "".join(d.content or "" for d in chunks) == whole.content


def test_chat_tells_a_story(client):
    out = client.chat.completions.create(model="tiny", max_tokens=60, temperature=0,
                                         messages=[{"role": "user", "content": "Tell me a story about a cat."}])
    message = out.choices[0].message
    words = message.content.split()
    assert len(words) >= 20 and message.reasoning_content is None
    known = known_words()
    assert sum(w in known for w in words) >= 0.9 * len(words), message.content


def test_echo_gives_prompt_logprobs_as_lm_eval_reads_them(client, server_url):
    ids = httpx.post(f"{server_url}/tokenize",
                     json={"prompt": "Once upon a time, there was a little cat."}, timeout=60).json()["tokens"]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert out.choices[0].text.startswith("Once upon a time, there was a little cat.")
    assert all(max(top.values()) >= value - 1e-6 for top, value in zip(lp.top_logprobs[1:], lp.token_logprobs[1:],
                                                                         strict=True))  # lm-eval's greedy check
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=1, logprobs=1, temperature=0).choices[0]
    assert plain.text == out.choices[0].text[len("Once upon a time, there was a little cat."):]
    assert plain.logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[-1], abs=1e-4)


def test_vllm_structured_output_names(client):
    for extra in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        out = client.completions.create(model="tiny", prompt="Once", max_tokens=5, extra_body=extra)
        assert out.choices[0].text in ("yes", "no")
    out = client.completions.create(model="tiny", prompt="Once", max_tokens=10,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert len(out.choices[0].text) == 3 and out.choices[0].text.isdigit()


def test_missing_routes_are_openai_errors(server_url):
    for path, status in (("/v1/embeddings", 501), ("/v1/responses", 501), ("/v1/nothing", 404)):
        r = httpx.post(server_url + path, json={"model": "tiny", "input": "x"}, timeout=30)
        assert r.status_code == status and r.json()["error"]["code"] == status and r.json()["error"]["message"]
    assert httpx.get(server_url + "/tokenize", timeout=30).status_code == 405
