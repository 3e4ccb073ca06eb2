"""Request limits: a body over ``--max-request-body-bytes`` is a 413 (declared or streamed), a count over its limit
a 400 naming the field and the flag; a request at the limit passes; the flags set them and refuse nonsense."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from deepinfer.entrypoints.cli import main
from deepinfer.entrypoints.openai.limits import ServerLimits, limits_from_args
from tests.support.app_client import assert_error, client_for

LIMITS = ServerLimits(max_request_body_bytes=4096, max_prompts_per_request=3, max_stop_sequences=2,
                      max_stop_sequence_length=8, max_messages=3, max_tools=2)
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def limited(toy_engine):
    with client_for(toy_engine, LIMITS) as c:
        yield c


def test_a_body_over_the_limit_is_a_413_declared_or_streamed(limited):
    big = b'{"prompt": "' + b"a" * 5000 + b'"}'
    error = assert_error(limited.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
                         413, None)
    assert "4096 bytes" in error["message"] and "--max-request-body-bytes" in error["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    streamed = limited.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(streamed, 413, None)
    fits = limited.post("/v1/completions", json={"prompt": "a" * 3000, "max_tokens": 1})
    assert fits.status_code != 413


@pytest.mark.parametrize(("endpoint", "body", "param", "flag"), [
    ("completions", {"prompt": ["a", "b", "c", "d"]}, "prompt", "--max-prompts-per-request"),
    ("completions", {"prompt": [[5], [6], [7], [8]]}, "prompt", "--max-prompts-per-request"),
    ("completions", {"prompt": "a", "stop": ["x", "y", "z"]}, "stop", "--max-stop-sequences"),
    ("completions", {"prompt": "a", "stop": "longer than eight"}, "stop", "--max-stop-sequence-length"),
    ("completions", {"prompt": "a", "stop_token_ids": [1, 2, 3]}, "stop_token_ids", "--max-stop-sequences"),
    ("chat/completions", {**CHAT, "messages": CHAT["messages"] * 4}, "messages", "--max-messages"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(3)]},
     "tools", "--max-tools"),
])
def test_counts_over_their_limit_are_400s_naming_field_and_flag(limited, endpoint, body, param, flag):
    error = assert_error(limited.post(f"/v1/{endpoint}", json={"max_tokens": 1, **body}), 400, param)
    assert flag in error["message"] and "at most" in error["message"]


def test_requests_at_the_limits_pass(limited):
    out = limited.post("/v1/completions", json={"prompt": ["a", "b", "c"], "stop": ["x", "12345678"],
                                                "stop_token_ids": [1, 2], "max_tokens": 1})
    assert out.status_code == 200 and len(out.json()["choices"]) == 3
    chat = limited.post("/v1/chat/completions", json={**CHAT, "messages": CHAT["messages"] * 3})
    assert chat.status_code == 200


def test_the_default_limits_pass_ordinary_requests(client):
    prompts = [[5, 6, 7]] * 64
    out = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 1, "stop": ["."] * 16})
    assert out.status_code == 200 and len(out.json()["choices"]) == 64


def test_flags_set_the_limits_and_refuse_nonsense(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--max-request-body-bytes", "--max-prompts-per-request", "--max-stop-sequences",
                 "--max-stop-sequence-length", "--max-messages", "--max-tools", "--api-key", "--allowed-hosts"):
        assert flag in text
    with pytest.raises(SystemExit):
        main(["serve", "--max-messages", "0"])
    assert "--max-messages must be an integer >= 1, got 0" in capsys.readouterr().err
    defaults = {f.name: getattr(ServerLimits(), f.name) for f in dataclasses.fields(ServerLimits)}
    assert limits_from_args(argparse.Namespace(**{**defaults, "max_tools": 7})) == ServerLimits(max_tools=7)
