"""``LLM``: the offline API (vLLM's shape).  Load a model once, then ``generate`` batches of prompts."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from deepinfer import envs
from deepinfer.backends.backend import Backend
from deepinfer.chat.template import ChatFormat, JinjaFormat, render_prompt, select_chat_format
from deepinfer.engine.args import EngineArgs, resolve_dtype
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.data_parallel import DataParallelEngine
from deepinfer.engine.engine import Engine
from deepinfer.engine.model_source import resolve_model
from deepinfer.engine.plan_check import check_memory_plan
from deepinfer.engine.rank_launch import Joined, RankEnv, join_world, leave_world, release, stop_peers
from deepinfer.engine.rank_processes import PeerLink, PeerMain, reporting_dead_peers, wait_for
from deepinfer.engine.sizing import check_max_model_len, fit_max_model_len, model_max_len
from deepinfer.engine.state_cache import StateCache, state_budget
from deepinfer.engine.stream import OutputStream
from deepinfer.models import load_model, read_model_config
from deepinfer.models.base import CausalLM, PrefixCacheable
from deepinfer.models.weights_mode import weights_mode
from deepinfer.ops import Ops
from deepinfer.outputs import RequestOutput
from deepinfer.parallel.plan import ParallelConfig
from deepinfer.sample.sampler import TokenMaskProvider
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec_decode.drafter import DraftingModel

logger = logging.getLogger(__name__)

#: Knobs of ``EngineArgs`` that only apply when ``LLM(...)`` loads a checkpoint, so ``from_model`` refuses them.
_LOAD_ONLY = {
    "model": "the model is already built (pass it as the first argument)",
    "tokenizer": "pass the tokenizer object as the second argument",
    "revision": "it picks a Hub revision when LLM(...) loads a checkpoint; the model is already built",
    "dtype": "the model is already built in its dtype",
    **{name: "ranks are started, and each builds its share of the experts, when LLM(...) loads the model "
       "(docs/parallel.md)" for name in ("data_parallel_size", "expert_parallel_size", "context_parallel_size",
                                         "num_redundant_experts", "eplb_step_interval", "distributed_timeout")},
    "engram_placement": "it says where LLM(...) loads V4.1's Engram tables; the model is already built",
}


def _eos_token_ids(checkpoint: Path | None, model: CausalLM, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else the model config, else the tokenizer."""
    candidates: list[Any] = []
    gen = checkpoint / "generation_config.json" if checkpoint else None
    if gen is not None and gen.is_file():
        candidates.append(json.loads(gen.read_text()).get("eos_token_id"))
    candidates.append(getattr(getattr(model, "config", None), "eos_token_id", None))
    candidates.append(getattr(tokenizer, "eos_token_id", None))
    for value in candidates:
        if value is not None:
            return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)
    return ()


def _prefix_caching(args: EngineArgs, model: CausalLM, joined: Joined | None) -> bool:
    """``enable_prefix_caching``, its default (None) resolved: on for a single-rank engine over a model with a
    prefix cache, where hits are exact and tested (docs/prefix_caching.md); off on several ranks."""
    if args.enable_prefix_caching is not None:
        return args.enable_prefix_caching
    return joined is None and isinstance(model, PrefixCacheable)


def drafter_off(backend: Backend, captured_decode: bool, several_ranks: bool, env: envs.SpecDecodeEnv) -> str | None:
    """Why speculative decoding stays off whatever drafter the checkpoint ships (None: on, with it), known before
    the weights load, so a drafter that will not run is neither read nor built.

    Off with ``DEEPINFER_USE_NEXTN_DECODE=0``; on several ranks (their lock-stepped loop runs one forward a step:
    an explicit ``DEEPINFER_USE_NEXTN_DECODE`` is refused); and, unless that variable is set, where the engine
    replays captured decode graphs (``captured_decode`` on a backend that really captures, e.g. CUDA): there a
    verify step of k drafts reads the experts of k + 1 tokens' routes, and drafting loses to captured plain
    decoding below an acceptance of ~3 tokens a step (docs/spec_decode.md has the H200 measurements)."""
    if env.draft_len == 0:
        return "speculative decoding off: DEEPINFER_USE_NEXTN_DECODE=0"
    if several_ranks:
        if env.draft_len_set:
            raise ValueError("DEEPINFER_USE_NEXTN_DECODE on several ranks: speculative decoding runs several "
                             "forwards a step, which the lock-stepped data-parallel loop does not support yet; "
                             "set DEEPINFER_USE_NEXTN_DECODE=0 or run one rank")
        return "speculative decoding off: it is not supported on several ranks yet (docs/parallel.md)"
    captures = type(backend).graph_capture is not Backend.graph_capture
    if captures and captured_decode and not env.draft_len_set:
        return (f"speculative decoding off by default on backend {backend.name!r}, which replays decode steps from "
                "captured graphs (docs/spec_decode.md: where drafting pays there); set DEEPINFER_USE_NEXTN_DECODE "
                "(1 to the drafter's block size) to use the checkpoint's drafter")
    return None


def _as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (text, token ids or dict) or a list of them -> a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # a single tokenized prompt
        return list(prompts)
    raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")


class LLM:
    """An offline DeepSeek-V4 engine.

    ``LLM(model, **kwargs)``: ``model`` is a local checkpoint directory, a Hugging Face repo id, or ``None``
    (``DEEPINFER_HF_MODEL_DIR``, else the cached default, else the embedded tiny model; see
    ``deepinfer.engine.model_source``).  ``kwargs`` are the fields of :class:`~deepinfer.engine.args.EngineArgs`
    (vLLM's names: ``dtype``, ``seed``, ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``gpu_memory_utilization``, ``max_logprobs``, ``enforce_eager``, ``async_scheduling``, ``tokenizer``,
    ``revision``; and ``state_cache_bytes``; for several ranks (``docs/parallel.md``): ``data_parallel_size``,
    ``expert_parallel_size``, ``context_parallel_size``, ``num_redundant_experts``, ``eplb_step_interval``,
    ``distributed_timeout``); ``engram_placement`` (V4.1's Engram tables in ``"host"`` or ``"device"``
    memory).  Arguments and ``DEEPINFER_*`` variables are checked, and
    ``max_model_len`` against the checkpoint's config.json, before the weights load.
    """

    #: Lets the ranks this LLM started go, once (kills them, leaves the process group): at shutdown, or when the
    #: LLM is dropped without it.
    _release: Callable[[], object] | None = None

    def __init__(self, model: str | os.PathLike[str] | None = None, **kwargs: Any):
        self._load(model, kwargs)

    def _load(self, model: str | os.PathLike[str] | None, kwargs: dict[str, Any], link: PeerLink | None = None
              ) -> None:
        """``LLM(model, **kwargs)``; ``link``: a self-launched rank's line to the rank 0 that started it."""
        from deepinfer.backends import current_backend
        from deepinfer.ops import OpTable

        args = EngineArgs.from_kwargs({"model": model, **kwargs})
        envs.validate()
        source = resolve_model(args.model, args.revision)
        model_config = read_model_config(source.path)
        check_max_model_len(args.max_model_len, model_max_len(model_config))
        dtype = resolve_dtype(args.dtype, source.path)
        backend = current_backend()
        ops = OpTable.for_backend(backend)
        joined = _join_ranks(args, backend, model_config, functools.partial(_serve_as_peer, model, kwargs), link)
        peers = joined.peers if joined is not None else []
        with reporting_dead_peers(peers):  # a rank that dies meanwhile is named, with its error
            device = backend.device(joined.local_rank if joined is not None else 0)
            # a drafter that will not run is neither read nor built (its tensors are still checked)
            spec_env = envs.spec_decode()  # read once for this engine
            speculating = drafter_off(backend, not args.enforce_eager, joined is not None, spec_env) is None
            # logged; refused here, before any weight is read
            check_memory_plan(source.path, args, dtype, backend, weights_mode(ops).name, speculating)
            lm = load_model(source.path, ops=ops, dtype=dtype, device=device,
                            parallel=joined.context if joined is not None else None, drafter=speculating,
                            engram_placement=args.engram_placement, backend=backend)
            tok = load_tokenizer(args.tokenizer if args.tokenizer is not None else source.path)
            self._setup(lm, tok, ops, _eos_token_ids(source.path, lm, tok), args, backend, model_path=source.path,
                        joined=joined, spec_env=spec_env)
            wait_for(peers, "ready", args.distributed_timeout)
        if peers:  # an LLM dropped without shutdown() lets its ranks go
            self._release = weakref.finalize(self, release, peers)
        config = self.engine.config
        kernels = sorted(ops.overridden)
        logger.info("model %s (%s), %s on backend %r (%s; %s); state cache %.1f MiB for up to %d sequences, "
                    "max_model_len %d", source.path, source.origin, str(dtype).removeprefix("torch."), backend.name,
                    device, f"its kernels for {', '.join(kernels)}, reference ops otherwise" if kernels
                    else "reference ops", config.state_cache_bytes / 2**20, config.max_num_seqs, config.max_model_len)

    @classmethod
    def from_model(cls, model: CausalLM, tokenizer: Any, *, ops: Ops | None = None,
                   eos_token_ids: Seq[int] | None = None, token_masks: TokenMaskProvider | None = None,
                   backend: Backend | None = None, **kwargs: Any) -> LLM:
        """An LLM over an already-built model (tests, custom loaders).  ``kwargs``: the run-time fields of
        :class:`~deepinfer.engine.args.EngineArgs` (not ``model``, ``tokenizer``, ``revision``, ``dtype``).
        ``backend``: the device services (graph capture, copies); default: the selected backend when it drives
        the model's device type, else the base class (plain copies, no graphs)."""
        from deepinfer.backends import current_backend
        from deepinfer.ops import OpTable

        args = EngineArgs.from_kwargs(kwargs, caller="LLM.from_model", excluded=_LOAD_ONLY,
                                      also=("ops", "eos_token_ids", "token_masks", "backend"))
        envs.validate()
        self = cls.__new__(cls)
        if backend is None:
            try:
                selected = current_backend()
            except Exception:  # noqa: BLE001 - an unusable DEEPINFER_ACCELERATOR: the model still runs
                selected = None
            same = selected is not None and selected.device_type == torch.device(model.device).type
            backend = selected if same and selected is not None else Backend()
        eos = tuple(eos_token_ids) if eos_token_ids is not None else _eos_token_ids(None, model, tokenizer)
        self._setup(model, tokenizer, ops if ops is not None else OpTable(), eos, args, backend, token_masks)
        return self

    def _setup(self, model: CausalLM, tokenizer: Any, ops: Ops, eos: tuple[int, ...], args: EngineArgs,
               backend: Backend, token_masks: TokenMaskProvider | None = None, model_path: Path | None = None,
               joined: Joined | None = None, spec_env: envs.SpecDecodeEnv | None = None) -> None:
        spec_env = spec_env if spec_env is not None else envs.spec_decode()  # read once for this engine
        prefix_caching = _prefix_caching(args, model, joined)
        state_cache = StateCache(model, args.max_num_seqs, state_budget(args, model, backend), prefix_caching)
        capacity = state_cache.capacity
        if capacity.max_seqs < args.max_num_seqs:
            logger.info("max_num_seqs lowered to %d: the state cache budget holds that many sequence slots",
                        capacity.max_seqs)
        config = EngineConfig(
            max_model_len=fit_max_model_len(args.max_model_len, model, capacity.nbytes, args.max_num_seqs),
            state_cache_bytes=capacity.nbytes, max_num_seqs=capacity.max_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, max_logprobs=args.max_logprobs,
            eos_token_ids=eos, async_scheduling=args.async_scheduling,
            enable_prefix_caching=prefix_caching,
            # expert-parallel steps exchange tokens with sizes known only on the host: not capturable
            enforce_eager=args.enforce_eager or (joined is not None and joined.context.plan.ep_size > 1),
        )
        self.engine_args = args
        #: The checkpoint directory (``None`` for ``from_model``).
        self.model_path = model_path
        self.engine = Engine(model, tokenizer, ops, config, state_cache, token_masks, backend, spec_env=spec_env)
        #: How ``chat`` renders conversations (``deepinfer.chat.template``); the server uses it too.
        self.chat_format: ChatFormat = select_chat_format(
            tokenizer, getattr(getattr(model, "config", None), "model_type", None), checkpoint=model_path)
        captured = self.engine.runner.decode_graphs is not None
        self._setup_drafter(model, drafter_off(backend, captured, joined is not None, spec_env), spec_env)
        self._request_ids = itertools.count()
        #: This rank's lock-stepped loop when the engine runs on several ranks (docs/parallel.md); else None.
        self.parallel = DataParallelEngine(self.engine, joined.context, args.eplb_step_interval,
                                           leads=bool(joined.peers)) if joined else None
        self._peers = joined.peers if joined is not None else []

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prompt block (vLLM's name): their pages go back to the state pool, and later requests
        compute their prompts from scratch until new prefixes are published.  False when prefix caching is off."""
        prefix = self.engine.state_cache.prefix
        if prefix is None:
            return False
        prefix.clear()
        return True

    def _setup_drafter(self, model: CausalLM, off: str | None, env: envs.SpecDecodeEnv) -> None:
        """Speculative decoding with the checkpoint's drafter, unless ``off`` says why not (:func:`drafter_off`):
        then it is not built."""
        if off is not None:
            logger.info(off)
            return
        drafter = model.make_drafter() if isinstance(model, DraftingModel) else None
        if drafter is None:
            if env.draft_len_set or env.varlen_set:
                logger.info("speculative decoding off: this checkpoint has no drafter (DEEPINFER_USE_NEXTN_DECODE "
                            "and DEEPINFER_ENABLE_MTP_VARLEN have no effect)")
            return
        self.engine.set_drafter(drafter)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for ``prompts``; one ``RequestOutput`` per prompt, in input order.

        ``prompts``: a string, a list of token ids, a ``{"prompt": str}`` / ``{"prompt_token_ids": list[int]}``
        dict (vLLM's ``TextPrompt`` / ``TokensPrompt``; a tokens prompt may also carry its ``"prompt"`` text),
        or a list of those.  ``sampling_params``: one for all prompts, or one per prompt (a list of another
        length raises ``ValueError``).

        Errors are reported per request: a bad request (empty prompt, longer than ``max_model_len``, a token
        id outside the vocabulary, a prompt dict of the wrong shape, text the tokenizer cannot encode,
        sampling parameters invalid for this engine, a grammar no output can satisfy) is not run; its
        ``RequestOutput`` has ``error`` set to a message naming the problem, ``outputs == []`` and
        ``finished == True``, and a warning is logged.  All other requests of the call complete normally.
        (Invalid values given to ``SamplingParams(...)`` itself raise ``ValueError`` at construction.)

        If the call itself fails (an exception or ``KeyboardInterrupt`` inside a step), it raises and the
        engine drops every request of the call: the next call runs on an empty engine.  Calls from several
        threads are served one after the other (each waits for the one running).
        """
        prompt_list, params_list = _pair(prompts, sampling_params)
        with self.engine.lock:
            try:
                if self.parallel is not None:
                    return self._run_parallel(prompt_list, params_list)
                return self._run(prompt_list, params_list, use_tqdm)
            except BaseException:
                self.engine.abort_all()  # whatever was interrupted, the next call starts from an empty engine
                raise

    def generate_stream(self, prompts: Any, sampling_params: SamplingParams | Seq[SamplingParams] | None = None
                        ) -> Iterator[RequestOutput]:
        """``generate``, yielding outputs as they come: after each engine step, one ``RequestOutput`` per request
        that has something new, shaped by its ``SamplingParams.output_kind`` (vLLM's: ``CUMULATIVE`` everything
        so far, ``DELTA`` only the new tokens and text, ``FINAL_ONLY`` one output at the end).  A request's
        last output has ``finished == True``; a rejected request yields its error output first.

        The engine is held while the generator runs: ``generate``, ``chat`` or another ``generate_stream`` on the
        same ``LLM`` from inside the loop (the same thread) raises ``RuntimeError``; from another thread it waits
        for this stream to finish.  Closing it early (``break``, ``close()``) drops this call's requests."""
        if self.parallel is not None:
            raise NotImplementedError("generate_stream runs one rank's engine step by step; with several ranks "
                                      "(docs/parallel.md) use generate")
        prompt_list, params_list = _pair(prompts, sampling_params)
        with self.engine.lock:
            try:
                yield from self._stream(prompt_list, params_list)
            except BaseException:  # GeneratorExit too: a consumer that stops early leaves an empty engine
                self.engine.abort_all()
                raise

    def _stream(self, prompts: list[Any], params: list[SamplingParams | None]) -> Iterator[RequestOutput]:
        engine = self.engine
        streams: dict[str, OutputStream] = {}
        for prompt, sp in zip(prompts, params, strict=True):
            request_id = str(next(self._request_ids))
            streams[request_id] = OutputStream(sp if sp is not None else SamplingParams())
            rejected = engine.add_request(prompt, sp, request_id)
            if rejected is not None:
                yield rejected
        while engine.has_unfinished():
            finished = engine.step()
            if not engine.has_unfinished():
                finished += engine.drain()
            for out in (*engine.take_updates(), *finished):
                shown = streams[out.request_id].next(out)
                if shown is not None:
                    yield shown

    def chat(self, messages: Seq[Mapping[str, Any]] | Seq[Seq[Mapping[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             tools: Seq[Mapping[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or a list of them.

        The conversation is rendered by the model's chat format (``self.chat_format``: the tokenizer's Jinja
        template, else the DeepSeek-V4.1 format for V4.1 checkpoints, else a plain transcript); ``chat_template``
        (Jinja text) overrides it.  ``tools``: OpenAI tool definitions the model may call.
        ``chat_template_kwargs``: passed to a Jinja template; the V4.1 format reads ``thinking`` (default off),
        ``reasoning_effort`` (``low`` / ``medium`` / ``high`` / ``max`` or 1..100; turns thinking on) and
        ``drop_thinking``.  Replies are raw text (``deepinfer.chat.ReplyParser`` splits reasoning and tool calls).
        A conversation that cannot be rendered raises ``ValueError`` (``ChatError``) naming the message;
        otherwise as ``generate``."""
        many = bool(messages) and not isinstance(messages[0], Mapping)
        conversations = list(messages) if many else [messages]
        chat_format = self.chat_format if chat_template is None else JinjaFormat(self.tokenizer, chat_template)
        tool_list = [dict(t) for t in tools] if tools is not None else None
        prompts = [render_prompt(self.tokenizer, chat_format, c, tool_list, add_generation_prompt,
                                 chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, prompts: list[Any], params: list[SamplingParams | None], use_tqdm: bool) -> list[RequestOutput]:
        """Queue every prompt, then step until all are done; the caller holds the engine's lock."""
        from tqdm.auto import tqdm

        engine = self.engine
        start, prompt0, gen0 = time.perf_counter(), engine.num_prompt_tokens, engine.num_generated_tokens
        results: list[RequestOutput | None] = []
        index: dict[str, int] = {}
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            request_id = str(next(self._request_ids))
            index[request_id] = i
            results.append(engine.add_request(prompt, sp, request_id))
        rejected = sum(r is not None for r in results)
        with tqdm(total=len(prompts), initial=rejected, desc="Processed prompts", unit="req", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            while engine.has_unfinished():
                finished = engine.step()
                if not engine.has_unfinished():
                    finished += engine.drain()
                for out in finished:
                    results[index[out.request_id]] = out
                if finished:
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"in: {(engine.num_prompt_tokens - prompt0) / elapsed:.1f} tok/s, "
                                        f"out: {(engine.num_generated_tokens - gen0) / elapsed:.1f} tok/s")
                    bar.update(len(finished))
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:  # cannot happen: every queued request finishes before the engine is empty
            raise RuntimeError(f"requests {missing} of this call finished without an output")
        return [r for r in results if r is not None]

    def _run_parallel(self, prompts: list[Any], params: list[SamplingParams | None]) -> list[RequestOutput]:
        """This rank's share of the call, in step with the other ranks (rank 0 of a self-launched world first
        sends them the call); every rank returns every output."""
        assert self.parallel is not None
        request_ids = [str(next(self._request_ids)) for _ in prompts]
        return self.parallel.generate(prompts, params, request_ids)

    def follow(self) -> None:
        """On a rank other than 0 of a parallel world: run the calls and serving steps rank 0 sends, until rank 0
        stops (``shutdown``).  Self-launched ranks do this; so do torchrun's ranks under ``deepinfer serve``."""
        if self.parallel is None or self.parallel.context.plan.rank == 0:
            raise RuntimeError("LLM.follow runs on the ranks other than 0 of a parallel world (docs/parallel.md)")
        self.parallel.follow(functools.partial(self.generate, use_tqdm=False))
        leave_world()

    def shutdown(self) -> None:
        """Stop the ranks that follow this rank 0 (those it started, or torchrun's following it under the
        server) and leave their process group (a new parallel ``LLM`` may start later); nothing otherwise."""
        if self.parallel is not None and self.parallel.leads:
            peers, self._peers = self._peers, []
            self.parallel.leads = False
            stop_peers(self.parallel.context, peers)
            if self._release is not None:
                self._release()  # once: dropping this LLM later must not touch a newer world
            leave_world()


def _join_ranks(args: EngineArgs, backend: Backend, model_config: Any, peer_main: PeerMain,
                link: PeerLink | None) -> Joined | None:
    """This process's place among the ranks the arguments ask for, or torchrun's (even a world of one, which
    runs the collectives on one device); None: one process.  ``peer_main``: what a rank this one starts runs;
    ``link``: this rank's line to the rank 0 that started it."""
    config = ParallelConfig(args.data_parallel_size, args.expert_parallel_size, args.context_parallel_size,
                            args.num_redundant_experts)
    if not config.enabled and RankEnv.from_environ() is None:
        return None
    return join_world(config, backend, model_config, args.distributed_timeout, peer_main, link)


def _serve_as_peer(model: str | os.PathLike[str] | None, kwargs: dict[str, Any], link: PeerLink) -> None:
    """A self-launched rank (started by rank 0's ``LLM``): the same ``LLM``, following rank 0."""
    llm = LLM.__new__(LLM)
    llm._load(model, kwargs, link)
    link.ready()
    llm.follow()


def _pair(prompts: Any, sampling_params: SamplingParams | Seq[SamplingParams] | None
          ) -> tuple[list[Any], list[SamplingParams | None]]:
    """The prompts as a list, and one ``SamplingParams`` (or None) per prompt."""
    prompt_list = _as_prompt_list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return prompt_list, [sampling_params] * len(prompt_list)
    params_list: list[SamplingParams | None] = list(sampling_params)
    if len(params_list) != len(prompt_list):
        raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts; "
                         "pass one SamplingParams or one per prompt")
    return prompt_list, params_list


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The checkpoint's tokenizer through transformers (never ``trust_remote_code``).  The model's config.json is
    not read for it (a blank config is passed): transformers may not know the model type (``deepseek_v41``)."""
    from transformers import AutoTokenizer, PretrainedConfig

    try:
        return AutoTokenizer.from_pretrained(os.fspath(path), config=PretrainedConfig(), trust_remote_code=False)
    except Exception as exc:
        raise RuntimeError(f"could not load a tokenizer from {os.fspath(path)!r} ({type(exc).__name__}: {exc}); the "
                           "checkpoint directory needs tokenizer.json and tokenizer_config.json") from exc
