"""``deepinfer serve`` on two self-launched ranks (DP 2 x EP 2): ``/v1/completions`` and ``/v1/chat/completions``,
two streams at once, give the greedy tokens the one-rank server gives; the ranks exit cleanly with the server.
(tests/core/parallel/test_serving_parallel.py checks the same engine loop on torchrun-style ranks, without HTTP,
with sampling, logprobs, aborts and rejections.)"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx

from tests.support.server import running_server

COMPLETION = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, ignore_eos=True)
CHAT = dict(model="tiny", messages=[{"role": "user", "content": "A story about a cat."}], max_tokens=12,
            temperature=0, ignore_eos=True)


async def _text(client: httpx.AsyncClient, url: str, body: dict, stream: bool) -> str:
    route = "chat/completions" if "messages" in body else "completions"
    if not stream:
        reply = (await client.post(f"{url}/v1/{route}", json=body)).json()
        choice = reply["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    pieces = []
    async with client.stream("POST", f"{url}/v1/{route}", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                pieces.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    assert len(pieces) > 1  # token by token
    return "".join(pieces)


async def _answers(url: str) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as client:
        alone = [await _text(client, url, COMPLETION, False), await _text(client, url, CHAT, False)]
        together = await asyncio.gather(_text(client, url, COMPLETION, True), _text(client, url, CHAT, True))
    return [*alone, *together]


def _children(port: int) -> list[int]:
    """The processes the server on ``port`` started (its ranks)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(port).encode() in argv:
            return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
    return []


def test_two_ranks_answer_as_one(server_url, tmp_path):
    expected = asyncio.run(_answers(server_url))
    log = tmp_path / "server.log"
    with running_server("--dtype", "float32", "--max-num-seqs", "16", "--served-model-name", "tiny",
                        "--data-parallel-size", "2", "--expert-parallel-size", "2", log=log) as url:
        assert asyncio.run(_answers(url)) == expected
        ranks = _children(int(url.rsplit(":", 1)[1]))
        assert len(ranks) == 1
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{pid}").exists() for pid in ranks):
        assert time.monotonic() < deadline, "the started rank outlived the server"
        time.sleep(0.2)
    text = log.read_text()
    assert "(rank 1) " in text and "Traceback" not in text and "terminate called" not in text
    assert "stopped the other ranks (exit codes [0])" in text  # told to stop, not left behind
