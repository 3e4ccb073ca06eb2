"""Data-parallel attention: each rank owns whole requests and runs its own engine; the ranks step together.

Every rank is given the same prompts (torchrun runs the same script everywhere; a self-launched ``LLM``
broadcasts them) and keeps prompt ``i`` when ``i % dp_size == dp_rank``: its own scheduler share, state
cache and sampler.  The loop is lock-stepped because expert-parallel MoE layers exchange tokens inside every
forward: per iteration every rank runs exactly one forward, a real step when it has work, else an idle one
that joins the MoE exchanges with no tokens, until no rank has work (one small all-reduce per iteration).
Every ``eplb_step_interval`` iterations the experts are rebalanced from the load counted meanwhile
(:mod:`deepinfer.layers.ep_rebalance`), between steps.  At the end every rank gathers every output, in prompt order.

Under the server (``engine_driver.LockstepDriver``) rank 0 leads step by step instead: each serving step it sends
the ranks the requests that arrived (each assigned to one DP rank), the aborts, and whether to step
(``dp_dispatch.StepOrders``); every rank applies them and runs the same lock-stepped iteration, then reports
its outputs to rank 0.  The other ranks follow (:meth:`DataParallelEngine.follow`): they run whatever rank 0
sends, offline calls and serving steps alike, until it says stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from deepinfer.engine.counters import EngineCounters
from deepinfer.engine.dp_dispatch import GenerateCall, RankReport, StepOrders
from deepinfer.engine.engine import Engine
from deepinfer.engine.output_deltas import DeltaSender
from deepinfer.layers.ep_rebalance import rebalance_experts
from deepinfer.outputs import RequestOutput
from deepinfer.parallel.context import ParallelContext
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class DataParallelEngine:
    """Drives one rank's :class:`~deepinfer.engine.engine.Engine` in step with the other ranks."""

    def __init__(self, engine: Engine, context: ParallelContext, eplb_step_interval: int | None = None,
                 leads: bool = False):
        self.engine, self.context, self.eplb_step_interval = engine, context, eplb_step_interval
        #: Rank 0 whose other ranks follow it (:meth:`follow`): it sends them each call and serving step.
        self.leads = leads
        self._sent = DeltaSender()
        #: Lock-stepped iterations so far (the same on every rank); rebalances so far.
        self.steps = 0
        self.rebalances = 0
        #: Why a call failed on this rank (the ranks are then out of step for good), or None.
        self.failed: str | None = None

    def owns(self, index: int) -> bool:
        plan = self.context.plan
        return index % plan.dp_size == plan.dp_rank

    def generate(self, prompts: list[Any], params: list[SamplingParams | None], request_ids: list[str]
                 ) -> list[RequestOutput]:
        """Run this rank's share of the prompts in step with the other ranks; every rank returns every output.
        A leading rank first sends the call to the ranks that follow it.  Once a call fails (an error here, or a
        rank that died), every later call raises: the ranks' collectives are out of step and only a new ``LLM``
        recovers."""
        with self._failing():
            if self.leads:
                self.context.control.broadcast_object(GenerateCall(prompts, params))
            return self._generate(prompts, params, request_ids)

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """Refuse to run once a call failed; mark this engine failed when this one does."""
        if self.failed is not None:
            raise RuntimeError(f"this parallel engine failed earlier ({self.failed}); its ranks are out of step: "
                               "start a new LLM")
        try:
            yield
        except BaseException as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            raise

    def follow(self, generate: Callable[[list[Any], list[SamplingParams | None]], object]) -> None:
        """A rank other than 0: run each call and serving step rank 0 sends (``generate`` runs a call), until it
        sends stop.  Waiting for the next one has no time limit (an idle server, a notebook between calls)."""
        while (message := self.context.control.broadcast_object(None)) is not None:
            if isinstance(message, StepOrders):
                self.serve_step(message)
            else:
                generate(message.prompts, message.params)

    def lead_step(self, orders: StepOrders) -> list[RankReport]:
        """Rank 0 under the server: send ``orders`` to the ranks, run them here too, and return every rank's
        report."""
        with self._failing():
            self.context.control.broadcast_object(orders)
            reports = self.serve_step(orders)
        assert reports is not None
        return reports

    def serve_step(self, orders: StepOrders) -> list[RankReport] | None:
        """Apply ``orders`` (the adds this DP rank owns, every abort), run one lock-stepped iteration if asked,
        and gather the ranks' reports on rank 0 (None elsewhere)."""
        engine, plan = self.engine, self.context.plan
        outputs: list[RequestOutput] = []
        for request_id in orders.aborts:
            engine.abort(request_id)
            self._sent.forget(request_id)
        for add in orders.adds:
            if add.dp_rank == plan.dp_rank and (
                    rejected := engine.add_request(add.prompt, add.params, add.request_id, *add.extra)) is not None:
                outputs.append(rejected)
        if not engine.has_unfinished():
            outputs += engine.drain()  # the step still in flight of requests just aborted
        if orders.step:
            finished = self.lockstep()
            outputs += [*engine.take_updates(), *finished]
        mine = [self._sent.encode(out) for out in outputs] if plan.cp_rank == 0 else []
        report = RankReport(plan.dp_rank, plan.cp_rank, mine, len(engine.requests), EngineCounters.of(engine))
        return self.context.host.gather_object(report)

    def _generate(self, prompts: list[Any], params: list[SamplingParams | None], request_ids: list[str]
                  ) -> list[RequestOutput]:
        engine, context = self.engine, self.context
        counts = context.host.all_gather_object(len(prompts))
        if len(set(counts)) > 1:
            raise ValueError(f"every rank must call generate with the same prompts; the ranks got {counts} prompts")
        mine: dict[int, RequestOutput] = {}
        index: dict[str, int] = {}
        for i, (prompt, sp, rid) in enumerate(zip(prompts, params, request_ids, strict=True)):
            sp = self.seeded(sp)  # on every rank, for every prompt: the draws stay in step with one process's
            if self.owns(i):
                index[rid] = i
                if (rejected := engine.add_request(prompt, sp, rid)) is not None:
                    mine[i] = rejected
        while context.host.any(engine.has_unfinished(), torch.device("cpu")):
            for out in self.lockstep():
                mine[index[out.request_id]] = out
        everything: dict[int, RequestOutput] = {}
        for part in context.host.all_gather_object(mine):
            everything.update(part)
        return [everything[i] for i in range(len(prompts))]

    def lockstep(self) -> list[RequestOutput]:
        """One iteration, the same on every rank: a step of this rank's engine when it has work (its finished
        requests are returned), else a forward with no tokens that joins the other ranks' exchanges; then EPLB
        when its interval comes."""
        engine, context = self.engine, self.context
        calls = context.moe_calls
        finished: list[RequestOutput] = []
        if engine.has_unfinished():
            finished = engine.step()
            if not engine.has_unfinished():
                finished += engine.drain()
        forwards = context.forwards_since(calls)
        if forwards > 1:
            raise RuntimeError(f"a step ran {forwards} forwards; the lock-stepped loop expects at most one")
        if forwards == 0:
            context.idle_forward()
        self.steps += 1
        if self.eplb_step_interval is not None and self.steps % self.eplb_step_interval == 0:
            self.rebalance()
        return finished

    def seeded(self, params: SamplingParams | None) -> SamplingParams | None:
        """``params`` with the seed the single-process engine would draw for it (from ``LLM(seed=...)``, in
        prompt order) when it has none.  A request the engine then rejects has drawn one (one process would
        not), so unseeded sampling after a rejected request differs from one process's."""
        sp = params if params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams) or sp.seq_seed is not None:
            return params
        seed = self.engine._seed_rng.getrandbits(64)  # the engine's own generator (Engine.add_request draws there)
        try:
            return dataclasses.replace(sp, seq_seed=seed, seed=seed)
        except (ValueError, TypeError):  # parameters made invalid after construction: the engine rejects them
            return params

    def rebalance(self) -> None:
        placement = rebalance_experts(self.context)
        if placement is not None:
            self.rebalances += 1
            logger.debug("rank %d: experts rebalanced (step %d)", self.context.plan.rank, self.steps)
