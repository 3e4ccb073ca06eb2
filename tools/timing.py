"""How the tools time things: device time of a call replayed from a CUDA graph (:func:`graph_time`), device time of
an eager call (:func:`device_time`), and synchronised wall and host times (:func:`time_median`, :func:`queue_time`).

``time_median`` and ``queue_time`` work on the CPU too (no CUDA: no synchronisation), so the benchmarks' ``--tiny``
runs test them there; the others need a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_time(fn: Callable[[], object], warmup: int = 25, rep: int = 200) -> float:
    """Seconds per call of ``fn`` run eagerly (host launch cost included where it exceeds the device's work):
    median of ``triton.testing.do_bench``'s CUDA-event timings."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e-3


def graph_time(fn: Callable[[], object], calls: int = 1, *, per_call: int = 1, warmup: int = 25,
               rep: int = 200) -> float:
    """Device seconds per call: ``fn`` captured ``calls`` times in one CUDA graph (after a warm-up on a side
    stream), the graph's replays timed by :func:`device_time`, divided by ``calls * per_call`` (``per_call``: the
    calls ``fn`` itself makes).  No host overhead in the number."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return device_time(graph.replay, warmup, rep) / (calls * per_call)


def time_median(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` (synchronised), after one warm-up call."""
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def queue_time(fn: Callable[[], object], repeats: int) -> float:
    """Median host time until ``fn`` returns, its device work queued but not awaited (after one warm-up call):
    below the synchronised wall time, the step is device-bound; near it, host-bound."""
    fn()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    sync()
    return statistics.median(samples)
