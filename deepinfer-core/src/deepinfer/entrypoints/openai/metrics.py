"""``GET /metrics``: the async engine's statistics through ``prometheus_client`` (text format 0.0.4).

Names are vLLM's with ``vllm:`` replaced by ``deepinfer:`` (``deepinfer:num_requests_running``,
``deepinfer:time_to_first_token_seconds``, ...), each labelled with ``model_name``; what vLLM has no name for
keeps DeepInfer's (``deepinfer:num_sequences``, ``deepinfer:state_cache_usage_perc``, the state cache's usage
that vLLM calls ``kv_cache_usage_perc``, exported under both names).  Values are read from ``EngineStats`` at
each scrape by a collector, so the engine thread never touches ``prometheus_client``; each scrape builds its
own registry (no process-global state).  Speculative decoding (DSpark) acceptance is counted per finished request,
as vLLM's ``spec_decode_*`` counters.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from deepinfer.engine.stats import EngineStats, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Histograms: (name, help, EngineStats field).
_HISTOGRAMS = (
    ("time_to_first_token_seconds", "Time to first token.", "time_to_first_token"),
    ("inter_token_latency_seconds", "Time between a request's consecutive token steps.", "inter_token_latency"),
    ("e2e_request_latency_seconds", "Arrival to finish of a request.", "e2e_request_latency"),
    ("request_queue_time_seconds", "Arrival to the first step the request was scheduled in.", "queue_time"),
    ("request_inference_time_seconds", "First scheduled step to finish.", "inference_time"),
    ("request_prefill_time_seconds", "First scheduled step to first token.", "prefill_time"),
    ("request_decode_time_seconds", "First token to last token.", "decode_time"),
)


class EngineCollector(Collector):
    """The metric families of one ``EngineStats``, read when Prometheus scrapes."""

    def __init__(self, stats: EngineStats, model: str):
        self.stats, self.model = stats, model

    def _gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"deepinfer:{name}", help_text, labels=["model_name"])
        family.add_metric([self.model], value)
        return family

    def _counter(self, name: str, help_text: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"deepinfer:{name}", help_text, labels=["model_name"])
        family.add_metric([self.model], value)
        return family

    def _histogram(self, name: str, help_text: str, h: Histogram) -> HistogramMetricFamily:
        family = HistogramMetricFamily(f"deepinfer:{name}", help_text, labels=["model_name"])
        buckets = [(floatToGoString(b), c) for b, c in zip(h.bounds, h.counts, strict=True)]
        family.add_metric([self.model], [*buckets, ("+Inf", h.count)], h.total)
        return family

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield self._gauge("num_requests_running", "Sequences running in the engine.", s.num_running)
        yield self._gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield self._gauge("num_sequences", "Sequences holding model state.", s.num_sequences)
        yield self._gauge("kv_cache_usage_perc", "Fraction of the state cache reserved (1 = full).",
                          s.state_cache_usage)
        yield self._gauge("state_cache_usage_perc", "The same as kv_cache_usage_perc (DeepInfer's name).",
                          s.state_cache_usage)
        yield self._counter("num_preemptions", "Preemptions since start.", s.num_preemptions)
        yield self._counter("prefix_cache_queries", "Prompt tokens of the sequences admitted after a prefix "
                            "cache lookup.", s.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Cached prompt tokens those sequences started from.",
                            s.prefix_cache_hits)
        yield self._gauge("prefix_cache_hit_rate", "Prefix cache hits / queries (tokens) since start.",
                          s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0)
        yield self._counter("prompt_tokens", "Prompt tokens of accepted requests.", s.prompt_tokens)
        yield self._counter("generation_tokens", "Generated tokens.", s.generation_tokens)
        success = CounterMetricFamily("deepinfer:request_success", "Finished requests by reason (stop, length, "
                                      "error, abort).", labels=["model_name", "finished_reason"])
        for reason in sorted({"stop", "length", "error", "abort", *s.requests}):
            success.add_metric([self.model, reason], s.requests[reason])
        yield success
        for name, help_text, field in _HISTOGRAMS:
            yield self._histogram(name, help_text, getattr(s, field))
        yield from self._spec_decode()

    def _spec_decode(self) -> Iterator[Metric]:
        s = self.stats
        yield self._counter("spec_decode_num_drafts", "Speculative verify steps of finished requests.",
                            s.spec_num_drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_num_draft_tokens)
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily("deepinfer:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each position of a draft block.",
                                      labels=["model_name", "position"])
        for pos, n in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([self.model, str(pos)], n)
        yield per_pos


def render(stats: EngineStats, model: str) -> str:
    """The exposition text of ``stats`` (what ``/metrics`` answers), from a registry of its own."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats, model))
    return generate_latest(registry).decode()
