"""Every failure in OpenAI's error shape with the right ``param``: strict types (refused as the offline
``SamplingParams`` refuses them), bodies that are not UTF-8, not JSON, too deep, of another content type, routes
that do not exist, and internal errors that show only an id."""

from __future__ import annotations

import json
import logging
import re

import pytest

from deepinfer import SamplingParams
from tests.support.app_client import assert_error, client_for, toy_async_engine
from tests.support.toy_model import ToyCausalLM

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(("field", "value"), [
    ("n", True), ("n", 2.0), ("max_tokens", "16"), ("max_tokens", True), ("seed", "7"), ("top_k", True),
    ("min_tokens", 1.0), ("logprobs", True), ("temperature", "1"), ("temperature", True), ("top_p", "0.5"),
    ("presence_penalty", False), ("ignore_eos", 1), ("ignore_eos", "true"), ("stop", 5), ("stop_token_ids", [True]),
])
def test_wrong_types_are_refused_as_sampling_params_refuses_them(client, field, value):
    with pytest.raises(ValueError):
        SamplingParams(**{field: value})
    response = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, field: value})
    error = assert_error(response, 400, "stop_token_ids.0" if field == "stop_token_ids" else field)
    bad = value[0] if isinstance(value, list) else value
    assert f"(got {type(bad).__name__} {bad!r})" in error["message"]


def test_chat_is_as_strict_and_an_int_is_a_float(client):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert_error(client.post("/v1/chat/completions", json={**chat, "n": True}), 400, "n")
    assert_error(client.post("/v1/chat/completions", json={**chat, "logprobs": 1}), 400, "logprobs")
    SamplingParams(temperature=1, top_p=1)
    ok = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "temperature": 1, "top_p": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


@pytest.mark.parametrize(("body", "param"), [
    (b'{"prompt": "Once \xff upon", "max_tokens": 2}', "prompt"),
    (b'{"model": "toy", "prompt": ["fine", "broken \xc3"], "max_tokens": 2}', "prompt.1"),
])
def test_invalid_utf8_names_the_field_holding_it(client, body, param):
    error = assert_error(client.post("/v1/completions", content=body, headers=JSON), 400, param)
    assert "not valid UTF-8" in error["message"]


def test_invalid_utf8_in_a_chat_message(client):
    body = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'
    error = assert_error(client.post("/v1/chat/completions", content=body, headers=JSON), 400, "messages.0.content")
    assert "byte 0xe9" in error["message"]


def test_invalid_json_and_deep_nesting(client):
    error = assert_error(client.post("/v1/completions", content=b'{"prompt": "Once",', headers=JSON), 400, None)
    assert "not valid JSON" in error["message"]
    deep = b'{"prompt": "Once", "so_args": {"json_schema": ' + b"[" * 5000 + b"]" * 5000 + b"}}"
    error = assert_error(client.post("/v1/completions", content=deep, headers=JSON), 400, "so_args")
    assert "more than 200 deep" in error["message"]
    array = client.post("/v1/completions", json=[1, 2])
    assert "must be a JSON object" in assert_error(array, 400, None)["message"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/json; charset=latin-1"])
def test_only_json_in_utf8_is_read(client, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = client.post("/v1/completions", content=b'{"prompt": "Once"}', headers=headers)
    assert "Content-Type: application/json" in assert_error(response, 415, None)["message"]
    ok = client.post("/v1/completions", content=b'{"prompt": "Once", "max_tokens": 1}',
                     headers={"content-type": "application/json; charset=UTF-8"})
    assert ok.status_code == 200


def test_unknown_routes_and_methods(client):
    assert "/v1" in assert_error(client.get("/v1/nothing"), 404, None)["message"]
    assert "GET" in assert_error(client.get("/v1/completions"), 405, None)["message"]


class _Failing(ToyCausalLM):
    """Its forward raises after ``steps_left`` steps, with text that must not reach a client."""

    steps_left = 0

    def forward(self, batch):
        if _Failing.steps_left <= 0:
            raise RuntimeError("device fell over reading /secret/weights.bin")
        _Failing.steps_left -= 1
        return super().forward(batch)


def test_internal_errors_show_an_id_and_the_log_has_the_rest(caplog):
    engine = toy_async_engine(_Failing)
    try:
        with client_for(engine) as client, caplog.at_level(logging.ERROR, logger="deepinfer"):
            _Failing.steps_left = 0
            response = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 8})
            error = assert_error(response, 500, None)
            _Failing.steps_left = 3
            stream = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 50, "ignore_eos": True,
                                                          "stream": True})
            events = [json.loads(line[6:]) for line in stream.text.splitlines()
                      if line.startswith("data: {")]
            assert stream.status_code == 200 and events[0]["choices"]  # it failed after tokens were sent
            streamed = events[-1]["error"]
            assert streamed["code"] == 500 and streamed["type"] == "server_error"
            assert client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2}).status_code == 500
    finally:
        engine.shutdown()
    for err in (error, streamed):
        assert "secret" not in err["message"] and "fell over" not in err["message"]
        error_id = re.search(r"err-[0-9a-f]{16}", err["message"]).group()
        logged = [r for r in caplog.records if error_id in r.getMessage()]
        assert logged and "fell over" in "".join(logging.Formatter().formatException(r.exc_info) for r in logged)
