"""/metrics through prometheus_client with vLLM's names; DSpark acceptance counters sum the finished requests';
queue time ends at the first schedule."""

from __future__ import annotations

import asyncio
import time

from deepinfer import SamplingParams
from deepinfer.engine.stats import EngineStats
from deepinfer.entrypoints.openai.metrics import render
from tests.support.app_client import toy_async_engine
from tests.support.server import parse_metrics
from tests.support.toy_model import ToyCausalLM


def test_spec_decode_counters_sum_finished_requests():
    stats = EngineStats()
    stats.add_spec(num_drafts=3, num_draft_tokens=12, num_accepted=7, per_pos=[3, 2, 1, 1])
    stats.add_spec(num_drafts=2, num_draft_tokens=4, num_accepted=1, per_pos=[1])
    m = parse_metrics(render(stats, "tiny"))
    label = 'model_name="tiny"'
    assert m[f"deepinfer:spec_decode_num_drafts_total{{{label}}}"] == 5
    assert m[f"deepinfer:spec_decode_num_draft_tokens_total{{{label}}}"] == 16
    assert m[f"deepinfer:spec_decode_num_accepted_tokens_total{{{label}}}"] == 8
    per_pos = [m[f'deepinfer:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{i}"}}']
               for i in range(4)]
    assert per_pos == [4, 2, 1, 1] and sum(per_pos) == 8


#: vLLM's metric names (``vllm:`` -> ``deepinfer:``) the server exports; counters without their ``_total``.
VLLM_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
              "prompt_tokens", "generation_tokens", "request_success", "prefix_cache_queries", "prefix_cache_hits",
              "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
              "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos")


def test_prometheus_client_exposition_with_vllm_names():
    from prometheus_client.parser import text_string_to_metric_families

    stats = EngineStats()
    for value in (0.003, 0.3, 30.0):
        stats.time_to_first_token.observe(value)
    stats.requests["length"] += 2
    families = {f.name: f for f in text_string_to_metric_families(render(stats, "tiny"))}
    assert {f"deepinfer:{name}" for name in VLLM_NAMES} <= set(families)
    assert families["deepinfer:request_success"].type == "counter"
    ttft = {s.labels.get("le"): s.value for s in families["deepinfer:time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket")}
    assert (ttft["0.001"], ttft["0.005"], ttft["0.5"], ttft["40.0"], ttft["+Inf"]) == (0, 1, 2, 3, 3)
    success = {s.labels["finished_reason"]: s.value for s in families["deepinfer:request_success"].samples}
    assert success["length"] == 2 and success["stop"] == 0


FORWARD_S = 0.3


class _SlowForward(ToyCausalLM):
    def forward(self, batch):
        time.sleep(FORWARD_S)
        return super().forward(batch)


def test_queue_time_ends_when_the_request_is_scheduled_not_after_its_forward_pass():
    engine = toy_async_engine(_SlowForward)

    async def one():
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        return [o async for o in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "r")][-1]

    try:
        out = asyncio.run(one())
    finally:
        engine.shutdown()
    m = out.metrics
    assert m.time_in_queue == m.first_scheduled_time - m.arrival_time < FORWARD_S / 2
    assert m.first_token_time - m.first_scheduled_time >= FORWARD_S
    stats = engine.stats
    assert stats.queue_time.count == 1 and stats.queue_time.total < FORWARD_S / 2
    assert stats.prefill_time.total >= FORWARD_S and stats.inference_time.total >= 2 * FORWARD_S
    assert stats.decode_time.count == 1 and stats.e2e_request_latency.total >= stats.inference_time.total
