"""Run a function on N gloo ranks (processes on the CPU) and collect what each returns.

Processes start from a fork server, not by forking pytest itself: a fork of a process that runs other threads
(torch's pools, an earlier test's engine loop) can inherit a lock another thread held and hang; it did in the
full suite.  So ``fn`` must be importable (a module-level function) and its arguments picklable."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queues
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alone(fn: Callable[..., Any], queue: Any, args: tuple) -> None:
    try:
        queue.put((0, "ok", fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((0, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_alone(fn: Callable[..., Any], *args: Any, join_s: float = 120.0) -> Any:
    """``fn(*args)`` in a new process with no process group (it may start its own ranks); its result."""
    ctx = mp.get_context("forkserver")
    queue = ctx.Queue()
    proc = ctx.Process(target=_alone, args=(fn, queue, args))
    proc.start()
    try:
        status, value = queue.get(timeout=join_s)[1:]
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise AssertionError(value)
    return value


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, timeout: float, queue: Any, args: tuple,
           backend_name: str) -> None:
    import torch

    from deepinfer.backends import select_backend

    torch.set_num_threads(1)
    # what torchrun sets, so that LLM(...) in ``fn`` joins this world as under torchrun
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DEEPINFER_ACCELERATOR=backend_name)
    try:
        backend = select_backend(backend_name)
        backend.init_communicator(rank, world, "env://", timeout, backend.device(rank))
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0, join_s: float = 120.0,
              backend: str = "cpu", start: str = "forkserver") -> dict[int, tuple[str, Any]]:
    """``fn(rank, world, *args)`` on ``world`` ranks with a gloo group (collective timeout ``timeout``) and
    torchrun's environment variables (``backend``: its collectives and rank ``r``'s device ``r``; ``start``: how
    processes start, ``spawn`` where the parent holds a GPU context, with ``fn`` importable);
    returns ``{rank: ("ok", result) | ("error", traceback)}`` (a rank that died without reporting is missing)."""
    ctx = mp.get_context(start)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, timeout, queue, args, backend), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + join_s
    while len(out) < world and time.monotonic() < deadline:  # read before joining: results may fill the pipe
        try:
            rank, status, value = queue.get(timeout=0.2)
        except queues.Empty:
            if not any(p.is_alive() for p in procs):
                break
            continue
        out[rank] = (status, value)
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    return out


def results(outcome: dict[int, tuple[str, Any]], world: int) -> list[Any]:
    """Every rank's result; raises with the failing ranks' tracebacks otherwise."""
    failed = {r: v for r, (s, v) in outcome.items() if s != "ok"}
    missing = [r for r in range(world) if r not in outcome]
    if failed or missing:
        raise AssertionError(f"ranks failed: {failed}; ranks that never reported: {missing}")
    return [outcome[r][1] for r in range(world)]

