"""``deepinfer serve`` answers the official ``openai`` client: completions, chat, streaming, JSON schema, errors."""

from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(server_url):
    with openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", timeout=120, max_retries=0) as c:
        yield c


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_completion_and_its_stream_agree(client):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text.strip()
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert len([c for c in chunks if c.choices]) > 1  # token by token, not one blob
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == 12


def test_completion_n_logprobs_stop_and_seed(client):
    kwargs = dict(model="tiny", prompt=["Tom had a ball.", "One day,"], max_tokens=16, temperature=1.0, n=2,
                  seed=7, logprobs=2, stop=["."])
    out = client.completions.create(**kwargs)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for c in out.choices:
        assert "." not in c.text
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
        assert all(len(top) >= 1 for top in c.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded


def test_chat_and_its_stream_agree(client):
    messages = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "A story about a cat."}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content and full.usage.completion_tokens == 16
    assert len(full.choices[0].logprobs.content) == full.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in full.choices[0].logprobs.content)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_json_schema_and_json_object(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Who are you?"}], max_tokens=80, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    obj = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=40,
                                         temperature=0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert obj.choices[0].message.content.lstrip().startswith("{")
    regex = client.completions.create(model="tiny", prompt="Once", max_tokens=10,
                                      extra_body={"so_args": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert regex.choices[0].finish_reason == "stop" and len(regex.choices[0].text) == 6


@pytest.mark.parametrize(("kwargs", "param"), [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(extra_body={"max_token": 3}), "max_token"),
    (dict(extra_body={"so_args": {"regex": "a", "ebnf": "b"}}), "so_args"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(extra_body={"guided_choice": []}), "guided_choice"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"jsn": {}}}), "structured_outputs"),
    (dict(extra_body={"guided_regex": "a", "so_args": {"regex": "b"}}), "so_args"),
    (dict(prompt=[10**6]), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=["Once", [10**6]]), "prompt"),
    (dict(prompt=[[5, 6, 7], [10**6]]), "prompt[1]"),
    (dict(prompt=["Once", "Le"], extra_body={"stop_token_ids": [10**6]}), "stop_token_ids"),
    (dict(stream_options={"include_usage": "maybe"}, stream=True), "stream_options.include_usage"),
    (dict(extra_body={"temperature": "hot"}), "temperature"),
])
def test_bad_completion_requests_are_400s_naming_the_field(client, kwargs, param):
    kwargs = {"model": "tiny", "prompt": "Once", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs)
    err = info.value.body
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err


def test_bad_chat_requests_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    assert info.value.body["param"] == "messages" and "messages[0].role" in info.value.body["message"]
    for kwargs, param in [(dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools"),
                          (dict(tool_choice="required"), "tool_choice"),
                          (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "f"}}),
                           "tool_choice"),
                          (dict(reasoning_effort="minimal"), "reasoning_effort"),
                          (dict(extra_body={"chat_template_kwargs": {"thinking": "yes"}}), "chat_template_kwargs")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], **kwargs)
        assert info.value.body["param"] == param, (kwargs, info.value.body)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
