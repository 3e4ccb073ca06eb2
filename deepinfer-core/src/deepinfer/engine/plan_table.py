"""A memory plan as text: a Markdown table (what ``deepinfer plan`` prints and ``docs/parallel.md`` quotes) and
the one line ``LLM`` logs."""

from __future__ import annotations

from deepinfer.engine.memory_plan import GiB, MemoryPlan, human


def _amount(n: int, unit: int) -> str:
    return f"{n / unit:,.2f}" if n else "-"


def describe_request(plan: MemoryPlan) -> str:
    r = plan.request
    engram = "on the device" if r.engram == "device" else "in host memory"
    shards = f"row-sharded over {r.expert_parallel_size} EP ranks" if r.shards_engram and r.expert_parallel_size > 1 \
        else "whole on every rank"
    weights = "as stored (native)" if r.quantized_weights == "native" else f"dequantized to {_dtype(plan)}"
    return (f"{plan.world_size} rank(s): data parallel {r.data_parallel_size} x context parallel "
            f"{r.context_parallel_size}, expert parallel {r.expert_parallel_size}; weights {weights}, compute "
            f"{_dtype(plan)}; Engram tables {engram}, {shards}; speculative decoding "
            f"{'on (DSpark drafter held)' if r.speculative else 'off (no drafter held)'}")


def _dtype(plan: MemoryPlan) -> str:
    return str(plan.request.dtype).removeprefix("torch.")


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a Markdown table of one rank's bytes, with its header and verdict lines."""
    r = plan.request
    unit, name = (GiB, "GiB") if sum(b.stored for b in plan.roles) >= GiB else (1 << 20, "MiB")

    def _gib(n: int) -> str:
        return _amount(n, unit)

    rows = [("role", "tensors", f"checkpoint {name}", f"device {name}", f"host {name}", f"of which scales {name}")]
    for b in plan.roles:
        rows.append((b.role, f"{b.tensors:,}", _gib(b.stored), _gib(b.device), _gib(b.host), _gib(b.scales)))
    tokens = min(r.max_model_len or 1 << 62, 8192)
    rows += [("weights", f"{sum(b.tensors for b in plan.roles):,}", _gib(sum(b.stored for b in plan.roles)),
              _gib(plan.weights_device), _gib(plan.weights_host), _gib(sum(b.scales for b in plan.roles))),
             (f"state pool ({r.max_num_seqs} x {tokens} tokens wanted: {_gib(plan.state_wanted)} {name})", "", "",
              _gib(plan.state), "", ""),
             ("DSpark context", "", "", _gib(plan.drafter_context), "", ""),
             (f"workspace (estimate, {r.max_num_batched_tokens} tokens a step)", "", "", _gib(plan.workspace), "",
              ""),
             ("total", "", "", _gib(plan.device_total), _gib(plan.weights_host), "")]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                                    strict=True)))
             + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths))
                 + "|")
    head = [f"Memory plan of {plan.source}", describe_request(plan),
            f"One rank (EP rank {plan.rank}, the one holding the most), {name} = 2^{30 if unit == GiB else 20} bytes:",
            ""]
    return "\n".join(head + lines + ["", verdict(plan)])


def verdict(plan: MemoryPlan) -> str:
    r = plan.request
    host = (f"host memory {human(plan.weights_host)} a rank, {human(plan.weights_host * plan.world_size)} for "
            f"{plan.world_size} rank(s)" if plan.weights_host else "nothing in host memory")
    if r.gpu_memory is None:
        return f"device memory not given (--gpu-memory GiB): fit not checked; {host}"
    problem = plan.problem()
    if problem is not None:
        return f"does NOT fit {human(r.gpu_memory)} a device: {problem}; {host}"
    return (f"fits {human(r.gpu_memory)} a device ({human(plan.device_total)} planned, "
            f"{human(r.gpu_memory - plan.device_total)} to spare); {host}")


def summary(plan: MemoryPlan) -> str:
    """One line for the log."""
    big = "; ".join(f"{b.role} {human(b.device)}" for b in sorted(plan.roles, key=lambda b: -b.device)[:3]
                    if b.device)
    return (f"memory plan per rank: weights {human(plan.weights_device)} on the device ({big}), "
            f"{human(plan.weights_host)} in host memory; state {human(plan.state)}, workspace "
            f"~{human(plan.workspace)}; {verdict(plan)}")
