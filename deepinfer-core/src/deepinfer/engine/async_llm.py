"""``AsyncLLM``: the engine loop under the server.  One thread owns the engine; asyncio callers stream from it.

``Engine`` is not thread-safe, so a single engine thread does everything to it: it takes the commands callers
queue (add a request, abort one), steps the engine while anything is unfinished, and hands each request's
outputs to its caller's ``asyncio.Queue`` (``loop.call_soon_threadsafe``).  Requests join between steps while
others run: continuous batching across callers.  Each caller iterates ``generate(...)``, an async generator of
``RequestOutput`` shaped by its ``SamplingParams.output_kind``; a caller that stops iterating (a client that
disconnected) aborts its request, which frees its state at the next step.

Work that grows with the request (tokenizing the prompt, checking its ids and length, compiling its grammar)
runs in a worker pool before the request reaches the engine thread (``engine/request_prep.py``), so a megabyte
prompt delays only itself, never the steps of requests already running; the server renders chat templates in
the same pool (:meth:`run_in_worker`).

On several ranks (``docs/parallel.md``) the thread runs on rank 0 and leads the others step by step; it sees
them through an ``engine_driver.EngineDriver`` (one rank: the engine itself).

The thread holds ``Engine.lock`` while it has work, so an offline ``LLM.generate`` on the same engine from
another thread waits until the async requests are done (and vice versa).  If a step raises, every request in
flight fails with that error and the engine is emptied (``Engine.abort_all``); the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from deepinfer.engine.engine import rejected_output
from deepinfer.engine.engine_driver import driver_for
from deepinfer.engine.llm import LLM
from deepinfer.engine.request_prep import RequestPrep
from deepinfer.engine.stats import EngineStats
from deepinfer.engine.stream import OutputStream
from deepinfer.outputs import RequestMetrics, RequestOutput
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


@dataclass(slots=True, eq=False)
class _Caller:
    """Where one request's outputs go, and what the stats need to remember between its outputs."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    stream: OutputStream
    last_token_time: float | None = None


class AsyncLLM:
    """An ``LLM`` served to asyncio callers by an engine thread (see the module docstring)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.engine = llm.engine
        self.driver = driver_for(llm)
        self.stats = EngineStats()
        self._commands: deque[tuple[str, Any]] = deque()
        self._wake = threading.Condition()
        self._callers: dict[str, _Caller] = {}
        self._stopping = False
        self._prep = RequestPrep(self.engine)
        self._thread = threading.Thread(target=self._loop, name="deepinfer-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.driver.failed is None

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread (requests still running are dropped)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)
        self._prep.shutdown()

    async def run_in_worker(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the prep pool (work that grows with the request: chat rendering)."""
        return await self._prep.run(fn, *args, **kwargs)

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them (per ``params.output_kind``); the last one has
        ``finished == True`` (a rejected request: one output with ``error``).  Leaving early aborts it."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        arrival_time = time.time()
        caller = _Caller(asyncio.get_running_loop(), asyncio.Queue(), OutputStream(params))
        finished = False
        try:
            prepared = await self._prep.run(self._prep.prepare, prompt, params, request_id, arrival_time)
            self._submit("add", (prepared, params, request_id, caller, arrival_time))
            while not finished:
                item = await caller.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Drop ``request_id`` (queued or running) and free its state; nothing if it already finished."""
        self._submit("abort", request_id)

    # --- the engine thread ----------------------------------------------------------------------
    def _submit(self, kind: str, payload: Any) -> None:
        with self._wake:
            self._commands.append((kind, payload))
            self._wake.notify()

    def _take_commands(self, block: bool) -> list[tuple[str, Any]] | None:
        """Queued commands (waiting for one if ``block``); ``None`` once shutting down."""
        with self._wake:
            while block and not self._commands and not self._stopping:
                self._wake.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _loop(self) -> None:
        try:
            while (commands := self._take_commands(block=True)) is not None:
                with self.engine.lock:
                    self._serve(commands)
        finally:
            self._fail_all(EngineDeadError("the engine loop stopped"))

    def _serve(self, commands: list[tuple[str, Any]] | None) -> None:
        """Apply ``commands`` and step until the engine is empty, taking new commands between steps."""
        while commands is not None:
            for kind, payload in commands:
                if kind == "add":
                    self._add(*payload)
                else:
                    self._abort(payload)
            if not self.driver.has_unfinished():
                for out in self.driver.drain():  # a step still in flight (its requests were aborted)
                    self._deliver(out)
                self._refresh_stats()
                return
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - the step failed: fail its requests, keep serving
                logger.exception("engine step failed; failing the %d requests in flight", len(self._callers))
                self.driver.abort_all()
                self._fail_all(RuntimeError(f"engine step failed ({type(exc).__name__}: {exc})"))
            commands = self._take_commands(block=False)

    def _add(self, prompt: Any, params: SamplingParams, request_id: str, caller: _Caller,
             arrival_time: float) -> None:
        rejected: RequestOutput | None
        if request_id in self._callers:
            rejected = rejected_output(request_id, None, f"request_id {request_id!r} is already running",
                                       arrival_time)
        elif isinstance(prompt, RequestOutput):  # refused by the worker
            rejected = prompt
        else:
            rejected = self.driver.add_request(prompt, params, request_id, arrival_time)
        if rejected is not None:
            self.stats.requests["error"] += 1
            caller.loop.call_soon_threadsafe(caller.queue.put_nowait, rejected)
            return
        self._callers[request_id] = caller

    def _abort(self, request_id: str) -> None:
        if self._callers.pop(request_id, None) is not None and self.driver.abort(request_id):
            self.stats.requests["abort"] += 1

    def _step(self) -> None:
        for update in self.driver.step():
            self._deliver(update)
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        self.driver.counters().copy_to(self.stats)

    def _deliver(self, out: RequestOutput) -> None:
        caller = self._callers.get(out.request_id)
        if caller is None:  # aborted while its last step was in flight
            return
        self._observe(caller, out)
        shown = caller.stream.next(out)
        if out.finished:
            del self._callers[out.request_id]
        if shown is not None:
            caller.loop.call_soon_threadsafe(caller.queue.put_nowait, shown)

    def _observe(self, caller: _Caller, out: RequestOutput) -> None:
        m, stats = out.metrics, self.stats
        if m is not None and m.last_token_time is not None and m.last_token_time != caller.last_token_time:
            if caller.last_token_time is None and m.first_token_time is not None:
                stats.time_to_first_token.observe(m.first_token_time - m.arrival_time)
            elif caller.last_token_time is not None:
                stats.inter_token_latency.observe(m.last_token_time - caller.last_token_time)
            caller.last_token_time = m.last_token_time
        if out.finished:
            reason = "error" if out.error is not None else (out.outputs[0].finish_reason or "stop")
            stats.requests[reason] += 1
            spec = out.spec_decoding_stats
            if spec is not None:
                stats.add_spec(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                               spec.num_accepted_tokens_per_pos)
            if m is not None and m.finished_time is not None:
                self._observe_phases(m, m.finished_time)

    def _observe_phases(self, m: RequestMetrics, finished: float) -> None:
        """A finished request's end-to-end latency and the phases it went through (vLLM's histograms)."""
        stats = self.stats
        stats.e2e_request_latency.observe(finished - m.arrival_time)
        if m.first_scheduled_time is None or m.time_in_queue is None:
            return
        stats.queue_time.observe(m.time_in_queue)
        stats.inference_time.observe(finished - m.first_scheduled_time)
        if m.first_token_time is not None and m.last_token_time is not None:
            stats.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
            stats.decode_time.observe(m.last_token_time - m.first_token_time)

    def _fail_all(self, exc: BaseException) -> None:
        callers, self._callers = self._callers, {}
        for caller in callers.values():
            try:
                caller.loop.call_soon_threadsafe(caller.queue.put_nowait, exc)
            except RuntimeError:  # its event loop is closed: nobody is waiting
                pass
