"""Load on loopback: concurrent streaming clients all complete, a malformed request fails alone, a killed client
frees its state, and ``/metrics`` is valid Prometheus text that counted it all.  Bounded in time."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.support.server import metric_key, parse_metrics

NUM_CLIENTS = 12
MAX_TOKENS = 20


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, list[dict]]:
    events = []
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return response.status_code, [json.loads(await response.aread())]
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return 200, events


def _metrics(url: str) -> dict[str, float]:
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return parse_metrics(response.text)


def _value(metrics: dict[str, float], name: str, **labels: str) -> float:
    return metrics[metric_key(name, model_name="tiny", **labels)]


def _wait_idle(url: str, timeout: float = 15.0) -> dict[str, float]:
    """Metrics once no sequence holds state (the engine thread refreshes them after each step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        if _value(m, "deepinfer:num_sequences") == 0 and _value(m, "deepinfer:num_requests_running") == 0:
            return m
        assert time.monotonic() < deadline, f"the engine did not empty: {m}"
        time.sleep(0.1)


def test_concurrent_streams_a_malformed_one_and_a_killed_client(server_url):
    before = _wait_idle(server_url)
    url = f"{server_url}/v1/completions"

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            good = [_stream(client, url, {"prompt": f"Story {i}: once upon a time", "max_tokens": MAX_TOKENS,
                                          "ignore_eos": True, "temperature": 1.0, "seed": i, "stream": True,
                                          "stream_options": {"include_usage": True}}) for i in range(NUM_CLIENTS)]
            bad = _stream(client, url, {"prompt": [10**6], "stream": True})
            chat = _stream(client, f"{server_url}/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_TOKENS,
                            "ignore_eos": True, "stream": True, "n": 2})
            return await asyncio.wait_for(asyncio.gather(*good, bad, chat), timeout=90)

    start = time.monotonic()
    *good, bad, chat = asyncio.run(main())
    for status, events in good:
        assert status == 200
        text_chunks = [e for e in events if e.get("choices")]
        assert len(text_chunks) > 1 and text_chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert bad[0] == 400 and bad[1][0]["error"]["param"] == "prompt"
    status, events = chat
    assert status == 200 and {c["index"] for e in events for c in e["choices"]} == {0, 1}
    assert time.monotonic() - start < 90

    # A client that goes away mid-stream (and one that gives up on a non-streaming request): both are aborted.
    long = {"prompt": "Once upon a time", "max_tokens": 100_000, "ignore_eos": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json={**long, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=long, timeout=1.0)

    after = _wait_idle(server_url)
    assert _value(after, "deepinfer:state_cache_usage_perc") == 0
    aborted = _value(after, "deepinfer:request_success_total", finished_reason="abort")
    assert aborted - _value(before, "deepinfer:request_success_total", finished_reason="abort") == 2
    finished = _value(after, "deepinfer:request_success_total", finished_reason="length")
    assert finished - _value(before, "deepinfer:request_success_total", finished_reason="length") == NUM_CLIENTS + 1
    generated = _value(after, "deepinfer:generation_tokens_total") - _value(before, "deepinfer:generation_tokens_total")
    assert generated >= (NUM_CLIENTS + 2) * MAX_TOKENS


def test_metrics_is_prometheus_text_with_histograms(server_url):
    httpx.post(f"{server_url}/v1/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=60)
    m = _metrics(server_url)
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        buckets = sorted(((float(k.split('le="')[1].split('"')[0]), v) for k, v in m.items()
                          if k.startswith(f"deepinfer:{name}_bucket")), key=lambda kv: kv[0])
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")  # cumulative, ending at +Inf
        assert counts[-1] == _value(m, f"deepinfer:{name}_count") > 0
    for name in ("num_requests_waiting", "num_preemptions_total", "prompt_tokens_total"):
        assert _value(m, f"deepinfer:{name}") >= 0
    # DSpark (the embedded model drafts on the CPU): accepted <= verified, and the positions add up
    drafted = _value(m, "deepinfer:spec_decode_num_draft_tokens_total")
    accepted = _value(m, "deepinfer:spec_decode_num_accepted_tokens_total")
    per_pos = [v for k, v in m.items() if k.startswith("deepinfer:spec_decode_num_accepted_tokens_per_pos_total")]
    assert 0 <= accepted <= drafted and drafted > 0 and sum(per_pos) == accepted
    assert httpx.get(f"{server_url}/health").status_code == 200
