"""``deepinfer serve`` with the embedded model's real tokenizer: a multi-megabyte prompt is tokenized while other
streams keep their pace, a body over the default limit is refused before it is read, and failures keep
OpenAI's shape through uvicorn."""

from __future__ import annotations

import json
import threading
import time

import httpx

#: Text that takes the embedded model's tokenizer seconds (it is then refused: longer than max_model_len).
BIG_PROMPT = "Once upon a time, a little cat sat on the mat and looked at the sun. " * 18_000  # ~1.2 MB


def _stream_times(url: str, stop: threading.Event, times: list[float]) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
            if stop.is_set():
                return


def test_a_huge_prompt_does_not_stall_running_streams(server_url):
    stop, times = threading.Event(), []
    streamer = threading.Thread(target=_stream_times, args=(server_url, stop, times), daemon=True)
    streamer.start()
    deadline = time.monotonic() + 60
    while len(times) < 5:
        assert time.monotonic() < deadline and streamer.is_alive(), "the stream did not start"
        time.sleep(0.01)
    start = time.monotonic()
    response = httpx.post(f"{server_url}/v1/completions", json={"prompt": BIG_PROMPT, "max_tokens": 4}, timeout=300)
    took = time.monotonic() - start
    stop.set()
    streamer.join(60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "prompt" and "max_model_len" in error["message"]
    during = [t for t in times if start <= t <= start + took]
    marks = [start, *during, start + took]
    gap = max(b - a for a, b in zip(marks, marks[1:], strict=False))
    # Tokenized on the engine thread, the stream would wait the whole time; off it, it keeps streaming.
    assert took > 1.0 and gap < took / 2 and len(during) >= 3, (took, gap, len(during))


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
