"""What the server's engine thread (``AsyncLLM``) drives: one rank's engine, or rank 0 leading several.

``AsyncLLM`` adds and aborts requests, steps while anything is unfinished and hands out the outputs; it does
so through an :class:`EngineDriver`, so the same loop serves one rank (:class:`LocalDriver`: the engine itself)
and a parallel world (:class:`LockstepDriver`, on rank 0).  Under the lock-stepped driver, requests and aborts
that arrive between two steps are sent to every rank with the next step (``dp_dispatch.StepOrders``), each
request owned by one data-parallel rank (the least loaded); every rank then runs one iteration together
(ranks without work join the expert-parallel exchanges with no tokens) and reports its outputs back, as deltas
(``output_deltas``).  A request the owner rejects comes back as its error output after the step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from deepinfer.engine.counters import EngineCounters
from deepinfer.engine.dp_dispatch import Assignment, Dispatcher, StepOrders
from deepinfer.engine.engine import rejected_output
from deepinfer.engine.output_deltas import DeltaReceiver
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.engine.data_parallel import DataParallelEngine
    from deepinfer.engine.engine import Engine
    from deepinfer.engine.llm import LLM


class EngineDriver(Protocol):
    """The engine as the server's engine thread sees it (called from that thread only)."""

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str, *extra: Any
                    ) -> RequestOutput | None:
        """Queue a request; its error output if it is refused now (a driver may report it after a step)."""
        ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """One step: the outputs of streaming requests that got tokens, then those that finished."""
        ...

    def drain(self) -> list[RequestOutput]:
        """Once nothing is unfinished: read a step still in flight."""
        ...

    def abort_all(self) -> None:
        """After a failed step: drop every request."""
        ...

    def counters(self) -> EngineCounters: ...

    @property
    def failed(self) -> str | None:
        """Why the engine cannot serve any more (its ranks are out of step), or None."""
        ...


class LocalDriver:
    """One rank's engine, stepped directly."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str, *extra: Any
                    ) -> RequestOutput | None:
        return self.engine.add_request(prompt, params, request_id, *extra)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        finished = engine.step()
        if not engine.has_unfinished():
            finished += engine.drain()
        return [*engine.take_updates(), *finished]

    def drain(self) -> list[RequestOutput]:
        return self.engine.drain()

    def abort_all(self) -> None:
        self.engine.abort_all()

    def counters(self) -> EngineCounters:
        return EngineCounters.of(self.engine)

    @property
    def failed(self) -> str | None:
        return None


class LockstepDriver:
    """Rank 0 leading a data-parallel (and expert- / context-parallel) world step by step; see the module
    docstring.  The other ranks run ``LLM.follow``."""

    def __init__(self, parallel: DataParallelEngine):
        self.parallel = parallel
        self.dispatcher = Dispatcher(parallel.context.plan.dp_size)
        self.received = DeltaReceiver()
        self._adds: list[Assignment] = []
        self._aborts: list[str] = []
        #: Whether some rank held unfinished requests after the last step.
        self._busy = False
        self._counters = EngineCounters.of(parallel.engine)

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str, *extra: Any
                    ) -> RequestOutput | None:
        if self.failed is not None:
            return rejected_output(request_id, prompt, f"the parallel engine failed ({self.failed}); restart the "
                                   "server", time.time())
        # an unseeded request draws its seed here, in arrival order, as the one-rank engine would
        seeded = self.parallel.seeded(params)
        self._adds.append(Assignment(self.dispatcher.assign(), request_id, prompt,
                                     seeded if seeded is not None else params, extra))
        return None

    def abort(self, request_id: str) -> bool:
        unsent = [a for a in self._adds if a.request_id == request_id]
        if unsent:
            self._adds.remove(unsent[0])
            self.dispatcher.loads[unsent[0].dp_rank] -= 1
        else:
            self._aborts.append(request_id)
        self.received.forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.failed is None and bool(self._adds or self._aborts or self._busy)

    def step(self) -> list[RequestOutput]:
        orders = StepOrders(self._adds, self._aborts, step=self._busy or bool(self._adds))
        self._adds, self._aborts = [], []
        reports = self.parallel.lead_step(orders)
        self._busy = any(r.num_requests for r in reports)
        self.dispatcher.observe(reports, self._adds)
        self._counters = EngineCounters.total([r.counters for r in reports if r.cp_rank == 0])
        return [self.received.decode(update) for r in reports for update in r.outputs]

    def drain(self) -> list[RequestOutput]:
        return []  # each rank reads its own steps in flight

    def abort_all(self) -> None:
        self._adds.clear()
        self._aborts.clear()
        self._busy = False

    def counters(self) -> EngineCounters:
        return self._counters

    @property
    def failed(self) -> str | None:
        return self.parallel.failed


def driver_for(llm: LLM) -> EngineDriver:
    """The driver for ``llm``: rank 0 of a parallel world leads the others (which must follow: self-launched
    ranks do, torchrun's run ``LLM.follow``); one rank drives its engine."""
    parallel = llm.parallel
    if parallel is None:
        return LocalDriver(llm.engine)
    if parallel.context.plan.rank != 0:
        raise ValueError("the server's engine loop runs on rank 0; the other ranks run LLM.follow() "
                         "(docs/parallel.md)")
    parallel.leads = True
    return LockstepDriver(parallel)
