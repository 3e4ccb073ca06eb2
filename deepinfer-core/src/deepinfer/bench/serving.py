"""``deepinfer bench serve``: drive a running ``deepinfer serve`` (or any OpenAI-compatible server) over HTTP.

Each request is a streaming ``/v1/completions`` call with a prompt of exactly ``--input-len`` token ids and
``max_tokens = --output-len`` with ``ignore_eos`` (vLLM's extension), so every request has the set lengths.
Requests arrive at ``--request-rate`` per second (Poisson; ``inf``: all at once), at most ``--max-concurrency``
in flight.  Per request: TTFT (send to first token), ITL (gaps between streamed chunks), TPOT
((latency - TTFT) / (output tokens - 1)) and end-to-end latency; the row has their percentiles and the
throughputs (per device: divided by ``--num-devices``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from deepinfer.bench.datasets import make_prompts
from deepinfer.bench.results import summarize, write_row


@dataclass(slots=True)
class RequestResult:
    prompt_len: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


async def _one(client: Any, url: str, model: str, prompt: list[int], args: argparse.Namespace) -> RequestResult:
    result = RequestResult(len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True,
            "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:500]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: "):])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                now = time.perf_counter()
                if data.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - start
        result.success = True
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, the benchmark goes on
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from deepinfer.engine.llm import load_tokenizer

    base = args.base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=None)) as client:
        info = (await client.get(f"{base}/v1/models")).json()["data"][0]
        model = args.served_model_name or info["id"]
        tokenizer = load_tokenizer(args.tokenizer or info["root"])
        prompts = make_prompts(tokenizer, args.dataset, args.num_prompts, args.input_len, args.dataset_path,
                               args.dataset_seed)
        limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
        rng = random.Random(args.dataset_seed)

        async def limited(prompt: list[int]) -> RequestResult:
            async with limit:
                return await _one(client, f"{base}/v1/completions", model, prompt, args)

        await _one(client, f"{base}/v1/completions", model, prompts[0][:8], argparse.Namespace(
            output_len=2, temperature=0.0))  # warm-up: connection and first-step costs
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return _row(args, model, results, duration)


def _row(args: argparse.Namespace, model: str, results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    devices = max(args.num_devices, 1)
    return {
        "benchmark": "serve", "model": model, "phase": args.label, "num_prompts": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:3],
        "input_len": args.input_len, "output_len": args.output_len, "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "num_devices": devices, "duration_s": duration,
        "request_throughput": len(ok) / duration, "input_throughput": n_in / duration,
        "output_throughput": n_out / duration, "total_token_throughput": (n_in + n_out) / duration,
        "input_throughput_per_device": n_in / duration / devices,
        "output_throughput_per_device": n_out / duration / devices,
        "per_user_output_throughput": (sum(1 / t for t in tpot) / len(tpot)) if tpot else 0.0,
        **summarize("ttft", [r.ttft for r in ok]), **summarize("tpot", tpot),
        **summarize("itl", [x for r in ok for x in r.itl]), **summarize("e2el", [r.latency for r in ok]),
        **{k: v for k, v in (args.extra or {}).items()},
    }


def run_serving(args: argparse.Namespace) -> dict[str, Any]:
    row = asyncio.run(_run(args))
    write_row(row, args.result_json, args.append)
    return row
