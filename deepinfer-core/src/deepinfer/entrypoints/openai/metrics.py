"""``GET /metrics``: the async engine's statistics in Prometheus' text format (version 0.0.4).

Names follow vLLM's (``vllm:`` becomes ``deepinfer:``), each labelled with ``model_name``.  Speculative decoding
(DSpark) acceptance is counted per finished request, as vLLM's ``spec_decode_*`` counters.
"""

from __future__ import annotations

from deepinfer.engine.stats import EngineStats, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Writer:
    def __init__(self, model: str):
        self.labels = f'model_name="{_label(model)}"'
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str, value: float, extra: str = "") -> None:
        self.header(name, kind, help_text)
        self.sample(name, value, extra)

    def header(self, name: str, kind: str, help_text: str) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, value: float, extra: str = "") -> None:
        self.lines.append(f"{name}{{{self.labels}{',' + extra if extra else ''}}} {_number(value)}")

    def histogram(self, name: str, help_text: str, h: Histogram) -> None:
        self.header(name, "histogram", help_text)
        for bound, count in zip(h.bounds, h.counts, strict=True):
            self.sample(f"{name}_bucket", count, f'le="{bound}"')
        self.sample(f"{name}_bucket", h.count, 'le="+Inf"')
        self.sample(f"{name}_sum", h.total)
        self.sample(f"{name}_count", h.count)


def render(stats: EngineStats, model: str) -> str:
    w = _Writer(model)
    w.metric("deepinfer:num_requests_running", "gauge", "Sequences running in the engine.", stats.num_running)
    w.metric("deepinfer:num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", stats.num_waiting)
    w.metric("deepinfer:num_sequences", "gauge", "Sequences holding model state.", stats.num_sequences)
    w.metric("deepinfer:state_cache_usage_perc", "gauge", "Fraction of the state cache reserved (1 = full).",
             stats.state_cache_usage)
    w.metric("deepinfer:num_preemptions_total", "counter", "Preemptions since start.", stats.num_preemptions)
    w.metric("deepinfer:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries)
    w.metric("deepinfer:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits)
    w.metric("deepinfer:prefix_cache_hit_rate", "gauge", "Prefix cache hits / queries (tokens) since start.",
             stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0)
    w.metric("deepinfer:prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", stats.prompt_tokens)
    w.metric("deepinfer:generation_tokens_total", "counter", "Generated tokens.", stats.generation_tokens)
    w.header("deepinfer:request_success_total", "counter",
             "Finished requests by reason (stop, length, error, abort).")
    for reason in sorted({"stop", "length", "error", "abort", *stats.requests}):
        w.sample("deepinfer:request_success_total", stats.requests[reason], f'finished_reason="{_label(reason)}"')
    w.histogram("deepinfer:time_to_first_token_seconds", "Time to first token.", stats.time_to_first_token)
    w.histogram("deepinfer:inter_token_latency_seconds", "Time between a request's consecutive token steps.",
                stats.inter_token_latency)
    w.histogram("deepinfer:e2e_request_latency_seconds", "Arrival to finish of a request.",
                stats.e2e_request_latency)
    w.histogram("deepinfer:request_queue_time_seconds", "Arrival to first scheduled step.", stats.queue_time)
    w.metric("deepinfer:spec_decode_num_drafts_total", "counter", "Speculative verify steps of finished requests.",
             stats.spec_num_drafts)
    w.metric("deepinfer:spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.",
             stats.spec_num_draft_tokens)
    w.metric("deepinfer:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
             stats.spec_num_accepted_tokens)
    w.header("deepinfer:spec_decode_num_accepted_tokens_per_pos_total", "counter",
             "Draft tokens accepted at each position of a draft block.")
    for pos, n in enumerate(stats.spec_accepted_per_pos):
        w.sample("deepinfer:spec_decode_num_accepted_tokens_per_pos_total", n, f'position="{pos}"')
    return "\n".join(w.lines) + "\n"
