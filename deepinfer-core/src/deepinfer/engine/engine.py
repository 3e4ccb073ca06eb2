"""The engine loop: add requests, then step until done.

One step is three stages with plain data between them; step N+1 is launched before step N is processed, so
the host's scheduling and processing overlap the device (async scheduling, see ``Engine.step``):

    schedule()  -> SchedulerOutput      which sequences run how many tokens (plain data)
    launch()    -> StepHandle           model forward + sampling queued on the device; collect() reads it
    process()   -> finished outputs     append tokens, detokenize, stop checks, free finished state
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from typing import Any

from deepinfer import envs
from deepinfer.backends import Backend
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.engine_lock import EngineLock
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.request import Request, Sequence, SequenceStatus
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.speculation import apply_results, policy_from_env
from deepinfer.engine.state_cache import StateCache
from deepinfer.engine.step_input import build_step_input
from deepinfer.engine.validation import RequestError, check_request, normalize_prompt
from deepinfer.models.base import CausalLM, Rewindable, SequenceState
from deepinfer.ops import Ops
from deepinfer.outputs import RequestMetrics, RequestOutput
from deepinfer.runner.model_runner import GraphLimits, ModelRunner
from deepinfer.runner.step_plan import StepHandle
from deepinfer.sample.sampler import Sampler, TokenMaskProvider
from deepinfer.sampling_params import RequestOutputKind, SamplingParams
from deepinfer.spec_decode.budget import SpecPolicy
from deepinfer.spec_decode.drafter import Drafter
from deepinfer.step import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_U64 = 1 << 64


def fork_seed(seed: int, index: int) -> int:
    """Seed of completion ``index`` of a request seeded with ``seed`` (index 0 keeps ``seed``)."""
    if index == 0:
        return seed % _U64
    x = (seed + index * 0x9E3779B97F4A7C15) % _U64  # splitmix64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % _U64
    return x ^ (x >> 31)


class Engine:
    """Continuous-batching generation over one model; see ``docs/engine.md``.

    Not thread-safe by itself: ``lock`` is held by ``LLM.generate`` for a whole call, so calls from several
    threads run one after the other.
    """

    def __init__(self, model: CausalLM, tokenizer: Any, ops: Ops, config: EngineConfig, state_cache: StateCache,
                 token_masks: TokenMaskProvider | None = None, backend: Backend | None = None,
                 drafter: Drafter | None = None, spec_env: envs.SpecDecodeEnv | None = None):
        """``state_cache``: the model's state, configured for ``config``'s limits; ``spec_env``: the speculative
        decoding variables (default: read now), which :meth:`set_drafter` follows unless given a policy."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.state_cache = state_cache
        self.scheduler = Scheduler(self.state_cache.budget, config.max_num_seqs, config.max_num_batched_tokens)
        if state_cache.prefix is not None:
            self.scheduler.prefix_lookup = self._prefix_lookup
        backend = backend if backend is not None else Backend()
        sampler = Sampler(ops, config.eos_token_ids, upload=backend.to_device)
        graphs = None if config.enforce_eager else GraphLimits(config.max_num_seqs, config.max_model_len)
        self.runner = ModelRunner(model, sampler, ops, token_masks, backend, graphs)
        self.outputs = OutputProcessor(tokenizer, config.eos_token_ids)
        self.token_masks: Any = token_masks
        self._seed_rng = random.Random(config.seed)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.seqs: dict[int, Sequence] = {}
        #: Requests queued or running, by id (finished and aborted ones are removed).
        self.requests: dict[str, Request] = {}
        #: Streaming requests (``output_kind`` not ``FINAL_ONLY``) that got tokens since ``take_updates``.
        self._updated: dict[str, Request] = {}
        #: Prefix caching: prompt tokens of the sequences looked up while scheduling this step, by sequence id.
        self._looked_up: dict[int, int] = {}
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        #: The step queued on the device whose results the host has not read yet (async scheduling).
        self._inflight: tuple[SchedulerOutput, StepHandle] | None = None
        #: Held by one ``LLM.generate`` call at a time (a second thread's call waits for it; the same thread's
        #: call inside its own open ``generate_stream`` raises).
        self.lock = EngineLock()
        self._spec_env = spec_env if spec_env is not None else envs.spec_decode()
        if drafter is not None:
            self.set_drafter(drafter)

    # --- speculative decoding -------------------------------------------------------------------
    @property
    def drafter(self) -> Drafter | None:
        """Speculative decoding's drafter, when it is on (:meth:`set_drafter`)."""
        return self.runner.drafter

    def set_drafter(self, drafter: Drafter | None, policy: SpecPolicy | None = None, *,
                    forced_acceptance: float | None = None) -> None:
        """Decode with ``drafter`` (None: without).  ``policy`` defaults to the environment's: draft length
        ``DEEPINFER_USE_NEXTN_DECODE`` (0: off) within the drafter's block, ``DEEPINFER_ENABLE_MTP_VARLEN``.
        ``forced_acceptance``: benchmarks only (lossy), see :meth:`ModelRunner.set_drafter
        <deepinfer.runner.model_runner.ModelRunner.set_drafter>`."""
        if self.seqs:
            raise RuntimeError("set_drafter: the engine has requests in progress")
        if drafter is not None and policy is None:
            policy = policy_from_env(drafter, self.model, self.runner.backend, self.config, self._spec_env)
        if drafter is not None and not isinstance(self.model, Rewindable):
            logger.info("speculative decoding off: %s cannot undo a forward", type(self.model).__name__)
            drafter = None
        if drafter is None or policy is None:
            drafter = policy = None
        else:
            logger.info("speculative decoding on: up to %d drafts a step, %s", policy.max_draft_len,
                        "confidence-scheduled verification" if policy.varlen else "every draft verified")
        self.runner.set_drafter(drafter, forced_acceptance=forced_acceptance if drafter is not None else None)
        self.scheduler.spec = policy
        self.state_cache.on_release = self._forget_draft_context if drafter is not None else None

    def _forget_draft_context(self, state: SequenceState) -> None:
        if self.drafter is not None:
            self.drafter.free(state)

    # --- requests -------------------------------------------------------------------------------
    def add_request(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> RequestOutput | None:
        """Queue one prompt.  A bad request is not queued: its error output is returned instead.

        Anything that goes wrong while checking one request (an invalid prompt or parameters, a prompt the
        tokenizer cannot encode, a grammar that does not compile) is that request's error; the engine is left
        as it was.  ``arrival_time`` (``time.time()``; default now) is when the request arrived: the server
        passes the moment it received it, so queue time and TTFT include the wait before this call."""
        params = params if params is not None else SamplingParams()
        arrival_time = arrival_time if arrival_time is not None else time.time()
        arrival = next(self._arrivals)
        request_id = request_id if request_id is not None else str(arrival)
        try:
            if request_id in self.requests:
                raise RequestError(f"request_id {request_id!r} is already queued or running; ids must be unique")
            if not isinstance(params, SamplingParams):
                raise RequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
            text, token_ids = normalize_prompt(prompt, self.tokenizer)
            check_request(token_ids, params, self.config, self.model.vocab_size, self.model,
                          self.tokenizer is not None)
            grammars = self._grammars(params)
        except RequestError as exc:
            logger.warning("request %s rejected: %s", request_id, exc)
            return rejected_output(request_id, prompt, str(exc), arrival_time)
        except Exception as exc:  # noqa: BLE001 - whatever fails while checking one request fails it alone
            logger.warning("request %s rejected", request_id, exc_info=True)
            return rejected_output(request_id, prompt,
                                   f"could not prepare the request ({type(exc).__name__}: {exc})", arrival_time)

        max_tokens = params.max_tokens if params.max_tokens is not None else self.config.max_model_len
        request = Request(
            request_id=request_id,
            arrival=arrival,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            max_total_tokens=min(len(token_ids) + max_tokens, self.config.max_model_len),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            metrics=RequestMetrics(arrival_time),
        )
        base_seed = params.seq_seed if params.seq_seed is not None else self._seed_rng.getrandbits(64)
        for index in range(params.n):
            seq = Sequence(next(self._seq_ids), request, index, list(token_ids), fork_seed(base_seed, index),
                           grammar=grammars[index])
            request.sequences.append(seq)
            self.seqs[seq.seq_id] = seq
        self.scheduler.add(request)
        self.requests[request_id] = request
        self.num_prompt_tokens += len(token_ids)
        return None

    def _grammars(self, params: SamplingParams) -> list[Any]:
        """One grammar matcher per completion (``None`` without ``so_args``); a bad grammar rejects the request."""
        if params.so_args is None:
            return [None] * params.n
        if self.token_masks is None:  # built on first use: compiling grammars needs xgrammar
            from deepinfer.structured import GrammarMaskProvider

            self.token_masks = GrammarMaskProvider(self.tokenizer, self.model.vocab_size, self.config.eos_token_ids)
            self.runner.set_token_masks(self.token_masks)
        try:
            first = self.token_masks.matcher(params.so_args)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if first.dead_end():
            raise RequestError(f"{first.label} admits no output: no token of this vocabulary can start it (it "
                               "matches no string, or only strings this tokenizer cannot spell)")
        return [first] + [first.fork() for _ in range(params.n - 1)]

    def abort_request(self, request: Request) -> None:
        for seq in request.sequences:
            self._retire(seq)
        self.requests.pop(request.request_id, None)
        self._updated.pop(request.request_id, None)
        if request.metrics.finished_time is None:
            request.metrics.finished_time = time.time()

    def abort(self, request_id: str) -> bool:
        """Drop the queued or running request ``request_id`` and free its state (a client went away).  Returns
        whether it was there; its tokens in flight are discarded when their step is read."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.abort_request(request)
        return True

    def take_updates(self) -> list[RequestOutput]:
        """Outputs of the unfinished streaming requests (``output_kind`` not ``FINAL_ONLY``) that got tokens since
        the last call, in arrival order.  Finished requests come from ``step`` instead.  The outputs share the
        live completion objects: read them before the next step (``deepinfer.engine.stream`` copies or slices)."""
        updated, self._updated = self._updated, {}
        return [self.outputs.request_output(r) for r in updated.values() if not r.finished]

    def abort_all(self) -> None:
        """Drop every request, the step in flight and all sequence state: the engine is empty, as new.

        Called when a ``generate`` call ends in an exception or an interrupt, which may come at any point of a
        step, so this resets every structure wholesale instead of retiring sequences one by one."""
        self._inflight = None
        try:  # device work of the interrupted step may still be queued: let it finish before its memory is reused
            self.runner.backend.synchronize(self.model.device)
        except Exception:  # noqa: BLE001 - the device error that ended the call; nothing left to wait for
            logger.debug("synchronize after an aborted call failed", exc_info=True)
        for seq in self.seqs.values():
            seq.status = SequenceStatus.FINISHED
            seq.num_inflight = 0
        self.seqs.clear()
        self.requests.clear()
        self._updated.clear()
        self.scheduler.clear()
        self.state_cache.clear()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # --- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the requests that finished in it.

        Async scheduling: the step is queued on the device, then the previous step's results are read and
        processed while it runs.  Tokens the previous step sampled reach this step on the device (the
        scheduler counts them as in flight).  A sequence that finishes on reading has one extra token
        computed, which is dropped.  Penalties count the in-flight token on the device.  Steps run one after
        the other instead when a sequence in flight has a grammar (its matcher must accept the token before
        the next mask), or when ``EngineConfig.async_scheduling`` is off.
        """
        done: list[RequestOutput] = []
        if self._inflight is not None and not self._may_overlap():
            done += self._land()
        sched = self.schedule()
        if sched.empty:
            # Nothing to run now is progress still when a step was in flight (reading it appends tokens and
            # retires sequences, which frees budget, even when no request finishes: a sibling of an ``n > 1``
            # request may be waiting) or when this step preempted.  Otherwise nothing can ever change.
            stalled = self._inflight is None and not sched.preempted
            done += self._land()
            if stalled and self.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (state budget too small?)")
            return done
        previous, self._inflight = self._inflight, (sched, self.launch(sched))
        done += self._process_landed(previous)
        if not self.config.async_scheduling or self.drafter is not None:  # (a speculative step is read already)
            done += self._land()
        return done

    def schedule(self) -> SchedulerOutput:
        """The scheduler's step, its preempted states freed, prefix hits attached, and each newly scheduled
        request's queue time stamped (now: before its forward pass runs)."""
        sched = self.scheduler.schedule()
        now = time.time()
        for seq_id in sched.preempted:
            self.state_cache.free(seq_id)
        looked_up, self._looked_up = self._looked_up, {}
        for chunk in sched.chunks:
            seq = self.seqs[chunk.seq_id]
            if chunk.seq_id in looked_up:  # admitted after a lookup: count what the cache serves it
                self.state_cache.count_lookup(looked_up[chunk.seq_id], seq.num_cached)
            if chunk.start and chunk.seq_id not in self.state_cache:  # past 0 without a state: a prefix hit
                self.state_cache.attach(chunk.seq_id, seq.token_ids, seq.num_cached, chunk.start)
            metrics = seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.time_in_queue = now - metrics.arrival_time
        return sched

    def _prefix_lookup(self, seq: Sequence) -> tuple[int, int]:
        """The scheduler's ``prefix_lookup``: requests that score their prompt compute it all.  The lookup is
        counted in the hit rate only if the sequence is admitted in this step (:meth:`schedule`), with the hit it
        then starts from: a waiting sequence may be looked up in several steps before it fits."""
        if seq.request.wants_prompt_logprobs:
            return 0, 0
        self._looked_up[seq.seq_id] = seq.prompt_len
        return self.state_cache.lookup(seq.token_ids[: seq.prompt_len], seq.prompt_len - 1)

    def _publish(self, sched: SchedulerOutput) -> None:
        """Cache the prompt blocks the step computed (its writes are queued before any later step's reads)."""
        for chunk in sched.chunks:
            seq = self.seqs[chunk.seq_id]
            if chunk.start < seq.prompt_len:
                self.state_cache.publish(chunk.seq_id, seq.token_ids,
                                         min(chunk.start + len(chunk.token_ids), seq.prompt_len))

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Queue ``sched`` on the device (tokens in flight come from the step before); nothing is read back."""
        previous = self._inflight[1] if self._inflight is not None else None
        handle = self.runner.launch(build_step_input(sched, self.seqs, self.state_cache), previous)
        if self.state_cache.prefix is not None:
            self._publish(sched)
        for chunk in sched.chunks:
            for child in chunk.fork_to:
                self.state_cache.fork(chunk.seq_id, child)
                if self.drafter is not None:
                    self.drafter.fork(self.state_cache.get(chunk.seq_id), self.state_cache.get(child))
        for seq_id in handle.seq_ids:
            self.seqs[seq_id].num_inflight += 1
        return handle

    def drain(self) -> list[RequestOutput]:
        """Read the step still in flight, if any."""
        return self._land()

    def _settle(self, handle: StepHandle) -> None:
        """The tokens ``handle`` sampled are no longer in flight (read, or abandoned)."""
        for seq_id in handle.seq_ids:
            seq = self.seqs.get(seq_id)
            if seq is not None:
                seq.num_inflight -= 1

    def _may_overlap(self) -> bool:
        """Whether the next step may be scheduled before the host reads the tokens in flight."""
        if not self.config.async_scheduling or self._inflight is None or self.drafter is not None:
            return False  # (a speculative step's acceptance decides what the next step feeds)
        for seq_id in self._inflight[1].seq_ids:
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.grammar is not None:
                return False
        return True

    def _land(self) -> list[RequestOutput]:
        inflight, self._inflight = self._inflight, None
        return self._process_landed(inflight)

    def _process_landed(self, inflight: tuple[SchedulerOutput, StepHandle] | None) -> list[RequestOutput]:
        if inflight is None:
            return []
        sched, handle = inflight
        result = handle.collect()
        self._settle(handle)
        return self.process(sched, result)

    def process(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        apply_results(result.spec, self.seqs)
        for seq_id, position, tl in result.prompt_logprobs:
            seq = self.seqs.get(seq_id)
            if seq is not None:
                self.outputs.record_prompt_logprobs(seq.request, position, tl)
        done: list[RequestOutput] = []
        now = time.time()
        for seq_id, tl in result.sampled:
            seq = self.seqs.get(seq_id)
            if seq is None or seq.status is SequenceStatus.FINISHED:  # finished while this step was in flight
                continue
            self.num_generated_tokens += 1
            request = seq.request
            metrics = request.metrics
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            if self.outputs.append_token(seq, tl):
                if request.error is not None:  # it failed while running: so does the whole request
                    logger.warning("request %s failed: %s", request.request_id, request.error)
                    self.abort_request(request)
                else:
                    self._retire(seq)
                if request.finished:
                    metrics.finished_time = now
                    self.requests.pop(request.request_id, None)
                    self._updated.pop(request.request_id, None)
                    done.append(self.outputs.request_output(request))
                    continue
            if request.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                self._updated[request.request_id] = request
        return done

    def _retire(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq)
        self.state_cache.free(seq.seq_id)
        self.seqs.pop(seq.seq_id, None)


def rejected_output(request_id: str, prompt: Any, error: str, arrival_time: float) -> RequestOutput:
    """The output of a request that was not run: its prompt as given (text, or ids when they are ints)."""
    ids: Any = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
    valid_ids = isinstance(ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    return RequestOutput(request_id, prompt if isinstance(prompt, str) else None, list(ids) if valid_ids else [],
                         None, outputs=[], finished=True, error=error,
                         metrics=RequestMetrics(arrival_time, finished_time=time.time()))
