"""Data-parallel attention: each rank owns whole requests and runs its own engine; the ranks step together.

Every rank is given the same prompts (torchrun runs the same script everywhere; a self-launched ``LLM``
broadcasts them) and keeps prompt ``i`` when ``i % dp_size == dp_rank``: its own scheduler share, state
cache and sampler.  The loop is lock-stepped because expert-parallel MoE layers exchange tokens inside every
forward: per iteration every rank runs exactly one forward, a real step when it has work, else an idle one
that joins the MoE exchanges with no tokens, until no rank has work (one small all-reduce per iteration).
Every ``eplb_step_interval`` iterations the experts are rebalanced from the load counted meanwhile
(:mod:`deepinfer.layers.ep_rebalance`), between steps.  At the end every rank gathers every output, in prompt order.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from deepinfer.engine.engine import Engine
from deepinfer.layers.ep_rebalance import rebalance_experts
from deepinfer.outputs import RequestOutput
from deepinfer.parallel.context import ParallelContext
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class DataParallelEngine:
    """Drives one rank's :class:`~deepinfer.engine.engine.Engine` in step with the other ranks."""

    def __init__(self, engine: Engine, context: ParallelContext, eplb_step_interval: int | None = None):
        self.engine, self.context, self.eplb_step_interval = engine, context, eplb_step_interval
        #: Lock-stepped iterations so far (the same on every rank); rebalances so far.
        self.steps = 0
        self.rebalances = 0
        #: Why a call failed on this rank (the ranks are then out of step for good), or None.
        self.failed: str | None = None

    def owns(self, index: int) -> bool:
        plan = self.context.plan
        return index % plan.dp_size == plan.dp_rank

    def generate(self, prompts: list[Any], params: list[SamplingParams | None], request_ids: list[str],
                 announce: bool = False) -> list[RequestOutput]:
        """Run this rank's share of the prompts in step with the other ranks; every rank returns every output.
        ``announce``: first send the call to the other ranks (rank 0 of a self-launched world).  Once a call
        fails (an error here, or a rank that died), every later call raises: the ranks' collectives are out of
        step and only a new ``LLM`` recovers."""
        if self.failed is not None:
            raise RuntimeError(f"this parallel engine failed earlier ({self.failed}); its ranks are out of step: "
                               "start a new LLM")
        try:
            if announce:
                self.context.host.broadcast_object((prompts, params))
            return self._generate(prompts, params, request_ids)
        except BaseException as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            raise

    def _generate(self, prompts: list[Any], params: list[SamplingParams | None], request_ids: list[str]
                  ) -> list[RequestOutput]:
        engine, context = self.engine, self.context
        counts = context.host.all_gather_object(len(prompts))
        if len(set(counts)) > 1:
            raise ValueError(f"every rank must call generate with the same prompts; the ranks got {counts} prompts")
        mine: dict[int, RequestOutput] = {}
        index: dict[str, int] = {}
        for i, (prompt, sp, rid) in enumerate(zip(prompts, params, request_ids, strict=True)):
            sp = self._seeded(sp)  # on every rank, for every prompt: the draws stay in step with one process's
            if self.owns(i):
                index[rid] = i
                if (rejected := engine.add_request(prompt, sp, rid)) is not None:
                    mine[i] = rejected
        while context.host.any(engine.has_unfinished(), torch.device("cpu")):
            calls = context.moe_calls
            if engine.has_unfinished():
                finished = engine.step()
                if not engine.has_unfinished():
                    finished += engine.drain()
                for out in finished:
                    mine[index[out.request_id]] = out
            forwards = context.forwards_since(calls)
            if forwards > 1:
                raise RuntimeError(f"a step ran {forwards} forwards; the lock-stepped loop expects at most one")
            if forwards == 0:
                context.idle_forward()
            self.steps += 1
            if self.eplb_step_interval is not None and self.steps % self.eplb_step_interval == 0:
                self.rebalance()
        everything: dict[int, RequestOutput] = {}
        for part in context.host.all_gather_object(mine):
            everything.update(part)
        return [everything[i] for i in range(len(prompts))]

    def _seeded(self, params: SamplingParams | None) -> SamplingParams | None:
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
