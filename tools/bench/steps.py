"""What the slice benchmarks share (``tools.bench.v4_slice``, ``tools.bench.v41_slice``): one DeepInfer step of a
pooled model (prefill, decode eager or replayed from CUDA graphs, a prefill captured once as a device-time
measurement), the cases they time, and per-kernel profiles.

Every function works on the CPU too (no CUDA: no synchronisation, graphs replayed eagerly by the CPU backend), so the
benchmarks' ``--tiny`` runs test them here.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from tools.timing import queue_time, sync, time_median


class SwitchableOps:
    """An op table the benchmark can swap under a built model (every layer keeps a reference to its ops)."""

    def __init__(self, table: Any):
        self.table = table

    def __getattr__(self, name: str) -> Any:
        return getattr(self.table, name)


def kernel_profile(fn: Callable[[], object], steps: int = 5, top: int = 25) -> str:
    """Device time per kernel name over ``steps`` calls of ``fn`` (after a warm-up), as a markdown table of the
    ``top`` most expensive: where a step's time goes (CUDA graph replays included: CUPTI records their kernels)."""
    fn()
    sync()
    return profile_table(kernel_totals(fn, steps), steps, top)


def experts_hit(model: Any, step: Callable[[], object]) -> list[int]:
    """Distinct routed experts each MoE layer of ``model`` picks in one call of ``step`` (run eagerly): what the
    step's expert kernels read, against the roofline's count for uniform routes ([] when no layer routes)."""
    layers = [layer.ffn for layer in getattr(model, "layers", []) if hasattr(getattr(layer, "ffn", None), "route")]
    hits: list[int] = []

    def counting(route: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            weights, ids = route(*args)
            hits.append(int(ids.unique().numel()))
            return weights, ids
        return wrapped

    for moe in layers:
        moe.route = counting(moe.route)
    try:
        step()
    finally:
        for moe in layers:
            del moe.route  # the class's method again
    return hits


def kernel_totals(fn: Callable[[], object], calls: int) -> dict[str, list[float]]:
    """Kernel name -> [device µs, launches] summed over ``calls`` calls of ``fn`` (no warm-up; CPU time of the
    profiled ops where there is no GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        us = getattr(event, "device_time", 0.0) if torch.cuda.is_available() else event.cpu_time
        if torch.cuda.is_available() and str(event.device_type) != "DeviceType.CUDA":
            continue
        entry = totals.setdefault(event.name[:90], [0.0, 0])
        entry[0] += us
        entry[1] += 1
    return totals


def profile_table(totals: dict[str, list[float]], steps: float, top: int = 25) -> str:
    """:func:`kernel_totals` per step (``steps`` of them) as a markdown table of the ``top`` most expensive."""
    total = sum(v[0] for v in totals.values()) or 1.0
    lines = [f"per step: {total / steps:.1f} us of kernels, {sum(int(v[1]) for v in totals.values()) / steps:.0f} "
             "launches", "", "| kernel | us / step | launches / step | share |", "|---|---:|---:|---:|"]
    for name, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| `{name}` | {us / steps:.1f} | {n / steps:.0f} | {us / total:.0%} |")
    return "\n".join(lines)


def backend_for(device: str) -> Any:
    """The DeepInfer backend that runs ``device``'s steps (uploads, graph capture)."""
    if device == "cuda":
        from deepinfer_cuda.plugin import CudaBackend

        return CudaBackend()
    from deepinfer.backends.cpu import CpuBackend

    return CpuBackend()


def jit_launches() -> dict[str, int]:
    """Kernel launches so far through Triton JIT (no cubin in the CUDA kernel set), by kernel."""
    from deepinfer_cuda.kernel_set.dispatch import _KERNELS

    return {k.name: k.launch_counts["jit"] for k in _KERNELS if k.launch_counts["jit"]}


def di_step(model: Any, ids: Any, positions: Any, lens: list[int], states: list[Any]) -> Any:
    """One DeepInfer step: forward, then the logits of each sequence's last row.  Host-built index tensors go
    through the backend's non-blocking copy, as in the engine's runner."""
    import torch

    from deepinfer.models import ForwardBatch

    upload = backend_for(ids.device.type).to_device
    hidden = model.forward(ForwardBatch(ids, positions, lens, states, to_device=upload))
    last = upload(torch.tensor(lens).cumsum(0) - 1, ids.device)
    return model.compute_logits(hidden[last])


def di_prefill(model: Any, tokens: Any, chunk_seqs: int = 8) -> list[Any]:
    """Fresh states holding ``tokens`` [B, S] (fed ``chunk_seqs`` sequences per forward)."""
    import torch

    batch, length = tokens.shape
    states = [model.new_state() for _ in range(batch)]
    positions = torch.arange(length, device=tokens.device)
    for first in range(0, batch, chunk_seqs):
        group = list(range(first, min(batch, first + chunk_seqs)))
        di_step(model, tokens[group].flatten(), positions.repeat(len(group)), [length] * len(group),
                [states[i] for i in group])
    return states


def di_prefill_once(model: Any, ids: Any, pos: Any) -> Any:
    state = model.new_state()
    try:
        return di_step(model, ids, pos, [len(ids)], [state])
    finally:
        state.release()


def di_decode_step(model: Any, states: list[Any], graphs: Any, device: str) -> Any:
    """One decode step of ``states`` (one random token each), eager or replayed from ``graphs``."""
    import torch

    batch = len(states)
    if graphs is None:
        ids = torch.randint(0, model.vocab_size, (batch,), device=device)
        pos = torch.tensor([s.num_tokens for s in states], device=device)
        return di_step(model, ids, pos, [1] * batch, states)
    ids = torch.randint(0, model.vocab_size, (batch,)).tolist()
    return graphs.run(states, ids)


def prefill_graph(model: Any, ids: Any, pos: Any) -> tuple[Callable[[], Any], Any] | None:
    """The prefill step captured in a CUDA graph (a measurement, not an engine path: its plan and uploads are
    frozen at capture): replaying it times the prefill's device work without the host's launches in the way.
    Returns (replay, the state it writes; release it when done) or None if the capture failed (or no CUDA)."""
    import torch

    if ids.device.type != "cuda":
        return None
    state = model.new_state()

    def step() -> None:
        state.num_tokens = 0  # the same chunk at position 0 again: same pages, same plan
        di_step(model, ids, pos, [len(ids)], [state])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph, stream=stream):
            step()
    except Exception as exc:  # noqa: BLE001 - report, keep the eager numbers
        print(f"prefill graph capture failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        state.release()
        return None
    return graph.replay, state


def host_costs(model: Any, graphs: Any, states: list[Any]) -> dict[str, float]:
    """Host seconds of a replayed decode step's parts (medians of 5): building the inputs, the upload, and the
    graph launch call (which returns before the device finishes)."""
    parts: dict[str, list[float]] = {"inputs": [], "upload": [], "launch": []}
    for _ in range(5):
        sync()
        rows, tokens = graphs.buckets(states)
        t0 = time.perf_counter()
        host = model.decode_inputs(states, [0] * len(states), rows, tokens)
        t1 = time.perf_counter()
        graph = graphs._graphs[rows, tokens]
        graph.stage(host)  # pack into pinned staging + queue the copy
        t2 = time.perf_counter()
        graph.replay()
        t3 = time.perf_counter()
        sync()
        for key, value in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            parts[key].append(value)
    return {k: statistics.median(v) for k, v in parts.items()}


def deepinfer_cases(model: Any, cases: list[str], use_graphs: bool, *, prefill: int, context: int, max_seqs: int,
                    device: str, profile: bool = False) -> dict[str, Any]:
    """Seconds per case (``prefill``: one ``prefill``-token sequence; ``decodeB``: a step of B sequences after
    ``context`` tokens each), plus each case's replay (device) time and host costs; decode steps replayed from
    CUDA graphs (captured per batch size, as the engine does) unless ``use_graphs`` is false."""
    import torch

    from deepinfer.runner.decode_graphs import DecodeGraphs

    vocab = model.vocab_size
    out: dict[str, Any] = {}
    with torch.inference_mode():
        if "prefill" in cases:
            ids = torch.randint(0, vocab, (prefill,), device=device)
            pos = torch.arange(prefill, device=device)
            out[f"prefill 1x{prefill}"] = time_median(lambda: di_prefill_once(model, ids, pos), 3)
            out[f"prefill 1x{prefill} host"] = {"queued": queue_time(lambda: di_prefill_once(model, ids, pos), 3)}
            captured = prefill_graph(model, ids, pos) if use_graphs else None
            if captured is not None:
                replay, state = captured
                out[f"prefill 1x{prefill} replay"] = time_median(replay, 3)
                if profile:
                    out[f"prefill 1x{prefill} profile"] = kernel_profile(replay, steps=2)
                state.release()  # its slot: the b64 case needs every one
        for case in cases:
            if not case.startswith("decode"):
                continue
            batch = int(case[len("decode"):])
            graphs = DecodeGraphs(model, backend_for(device), torch.device(device), max_seqs, context + 64) \
                if use_graphs else None
            states = di_prefill(model, torch.randint(0, vocab, (batch, context), device=device))
            steps = []
            for _ in range(8):
                sync()
                start = time.perf_counter()
                di_decode_step(model, states, graphs, device)
                sync()
                steps.append(time.perf_counter() - start)
            out[f"decode b{batch} ctx {context}"] = statistics.median(steps[2:])
            if graphs is not None:  # device time of the step alone: replays of its graph, back to back
                replay = graphs._graphs[graphs.buckets(states)].replay
                ten = time_median(lambda r=replay: [r() for _ in range(10)], 3)
                out[f"decode b{batch} ctx {context} replay"] = ten / 10
                out[f"decode b{batch} ctx {context} host"] = host_costs(model, graphs, states)
                if profile:
                    out[f"decode b{batch} ctx {context} profile"] = kernel_profile(replay)
            if profile:  # one more step, eager: the experts its routes hit
                out[f"decode b{batch} ctx {context} experts hit"] = experts_hit(
                    model, functools.partial(di_decode_step, model, states, None, device))
            for state in states:
                state.release()
            if graphs is not None:
                graphs.close()
            del states, graphs
            if device == "cuda":
                torch.cuda.empty_cache()
    return out
