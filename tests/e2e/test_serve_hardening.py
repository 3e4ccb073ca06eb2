"""``deepinfer serve`` with the embedded model's real tokenizer: a multi-megabyte prompt is tokenized while other
streams keep their pace, a body over the default limit is refused before it is read, and failures keep
OpenAI's shape through uvicorn."""

from __future__ import annotations

import json

import httpx

from tools.bench.serve_stall import measure as measure_stall


def test_a_huge_prompt_does_not_stall_running_streams(server_url):
    """``tools/bench/serve_stall.py``: a ~3 MB prompt takes the embedded tokenizer seconds (over one on an idle
    2-core host), then is refused (longer than max_model_len); a stream that runs meanwhile keeps streaming."""
    stall = measure_stall(server_url, megabytes=3.0)
    error = stall.body["error"]
    assert stall.status == 400 and error["param"] == "prompt" and "max_model_len" in error["message"]
    # Tokenized on the engine thread, the stream would wait the whole time; off it, it keeps streaming.
    assert stall.took > 1.0 and stall.longest_gap < stall.took / 2 and stall.chunks >= 3, stall


def test_a_body_over_the_default_limit_is_refused_unread(server_url):
    body = b'{"prompt": "' + b"a" * (33 << 20) + b'"}'
    response = httpx.post(f"{server_url}/v1/completions", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert "--max-request-body-bytes" in response.json()["error"]["message"]


def test_bad_bodies_through_uvicorn(server_url):
    headers = {"content-type": "application/json"}
    for content, status, param in [(b'{"prompt": "caf\xe9", "max_tokens": 2}', 400, "prompt"),
                                   (b'{"prompt": "a", "max_tokens": "16"}', 400, "max_tokens"),
                                   (b'{"prompt": "a", "n": true}', 400, "n")]:
        response = httpx.post(f"{server_url}/v1/completions", content=content, headers=headers, timeout=30)
        assert response.status_code == status and json.loads(response.text)["error"]["param"] == param
    assert httpx.post(f"{server_url}/v1/completions", content=b"{}", timeout=30).status_code == 415
