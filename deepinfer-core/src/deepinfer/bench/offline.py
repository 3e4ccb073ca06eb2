"""``deepinfer bench offline``: throughput and latency of ``LLM.generate`` on a batch of prompts of set lengths.

All prompts are queued at once (the engine batches them continuously); outputs run to ``--output-len`` tokens
(``ignore_eos``).  Per-request latencies come from ``RequestOutput.metrics``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from deepinfer.bench.datasets import make_prompts
from deepinfer.bench.results import summarize, write_row
from deepinfer.entrypoints.engine_flags import engine_kwargs


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    from deepinfer import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    prompts = make_prompts(llm.tokenizer, args.dataset, args.num_prompts, args.input_len, args.dataset_path,
                           args.dataset_seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    failed = [o for o in outputs if o.error is not None]
    done = [o for o in outputs if o.error is None]
    n_in = sum(len(o.prompt_token_ids) for o in done)
    n_out = sum(len(c.token_ids) for o in done for c in o.outputs)
    ttft, tpot, e2e = [], [], []
    for o in done:
        m = o.metrics
        if m is None or m.first_token_time is None or m.finished_time is None:
            continue
        ttft.append(m.first_token_time - m.arrival_time)
        e2e.append(m.finished_time - m.arrival_time)
        n = len(o.outputs[0].token_ids)
        if n > 1:
            tpot.append((m.finished_time - m.first_token_time) / (n - 1))
    row: dict[str, Any] = {
        "benchmark": "offline", "num_prompts": len(prompts), "completed": len(done), "failed": len(failed),
        "input_len": args.input_len, "output_len": args.output_len, "duration_s": elapsed,
        "request_throughput": len(done) / elapsed, "input_throughput": n_in / elapsed,
        "output_throughput": n_out / elapsed, "total_token_throughput": (n_in + n_out) / elapsed,
        **summarize("ttft", ttft), **summarize("tpot", tpot), **summarize("e2el", e2e),
    }
    write_row(row, args.result_json, args.append)
    return row
