"""``LLM``: the offline API (vLLM's shape).  Load a model once, then ``generate`` batches of prompts."""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from deepinfer import envs
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.engine import Engine
from deepinfer.engine.model_source import resolve_model
from deepinfer.models.base import CausalLM
from deepinfer.outputs import RequestOutput
from deepinfer.sample.sampler import TokenMaskProvider
from deepinfer.sampling_params import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, checkpoint: Path | None) -> torch.dtype:
    """``"auto"`` = the checkpoint's ``torch_dtype`` / ``dtype`` (bf16 if it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        config = json.loads((checkpoint / "config.json").read_text()) if checkpoint else {}
        dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto', a torch dtype or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


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


#: Tokens per sequence the default state cache budget is sized for (``max_num_seqs`` of them); longer
#: sequences still run, fewer at a time.
DEFAULT_STATE_TOKENS = 8192


def _fit_max_model_len(requested: int | None, model: CausalLM, budget: int) -> int:
    """``requested`` if one sequence of it fits the state budget; else the largest length that does."""
    model_max = getattr(getattr(model, "config", None), "max_position_embeddings", None) or (1 << 20)
    if requested is not None:
        if not isinstance(requested, int) or not 2 <= requested <= model_max:
            raise ValueError(f"max_model_len must be an integer in [2, {model_max}] for this model, got {requested!r}")
        if model.state_bytes(requested) > budget:
            raise ValueError(f"max_model_len={requested} needs {model.state_bytes(requested)} bytes of state for one "
                             f"sequence; the state cache budget is {budget} bytes: "
                             "lower max_model_len or raise the budget")
        return requested
    if model.state_bytes(model_max) <= budget:
        return model_max
    lo, hi = 1, model_max  # state_bytes(lo) fits, state_bytes(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if model.state_bytes(mid) <= budget else (lo, mid)
    if lo < 2:
        raise ValueError(f"the state cache budget ({budget} bytes) cannot hold even a 2-token sequence")
    logger.info("max_model_len set to %d (the most one sequence's state fits in %d bytes; the model allows %d)",
                lo, budget, model_max)
    return lo


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

    Args:
        model: local checkpoint directory, Hugging Face repo id, or ``None`` (``DEEPINFER_HF_MODEL_DIR``,
            else the cached default, else the embedded tiny model; see ``deepinfer.engine.model_source``).
        dtype: ``"auto"`` (the checkpoint's), a torch dtype or its name.
        seed: seeds the per-request seeds of requests without ``SamplingParams.seed``.
        max_model_len: longest prompt + output; default: the model's limit, lowered to what one
            sequence's state fits in the state cache budget.
        max_num_seqs / max_num_batched_tokens: per-step limits on sequences and tokens (chunked prefill).
        enforce_eager: run decode steps eagerly instead of replaying captured graphs (debugging).
        async_scheduling: queue each step before reading the previous one's tokens (default); False runs
            steps strictly one after the other (debugging; outputs are the same).
        state_cache_bytes: memory for all sequences' model state, allocated once; default: what
            ``max_num_seqs`` sequences of ``min(max_model_len, 8192)`` tokens need, at most
            ``memory_utilization`` times the device memory free after loading the weights.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, tokenizer: str | os.PathLike | None = None,
                 revision: str | None = None, dtype: str | torch.dtype = "auto", seed: int = 0,
                 max_model_len: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 state_cache_bytes: int | None = None, memory_utilization: float = 0.9,
                 max_logprobs: int = MAX_LOGPROBS, enforce_eager: bool = False, async_scheduling: bool = True):
        from deepinfer.backends import current_backend
        from deepinfer.ops import OpTable

        envs.check_consistency()
        if not 0 < memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization!r}")
        source = resolve_model(model, revision)
        backend = current_backend()
        ops = OpTable.for_backend(backend)
        device = backend.device()
        try:
            from deepinfer.models import load_model
        except ImportError as exc:
            raise RuntimeError(f"this build of deepinfer has no model loader yet ({exc})") from exc
        lm = load_model(source.path, ops=ops, dtype=resolve_dtype(dtype, source.path), device=device)
        tok = load_tokenizer(tokenizer if tokenizer is not None else source.path)
        if state_cache_bytes is None:
            model_max = max_model_len or getattr(lm.config, "max_position_embeddings", None) or (1 << 20)
            state_cache_bytes = min(int(memory_utilization * backend.memory_info(device)[0]),
                                    lm.state_pool_bytes(max_num_seqs, min(model_max, DEFAULT_STATE_TOKENS)))
        logger.info("model %s (%s) on %s; state cache %.1f MiB", source.path, source.origin, device,
                    state_cache_bytes / 2**20)
        self._setup(lm, tok, ops, _eos_token_ids(source.path, lm, tok), seed=seed, max_model_len=max_model_len,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    state_cache_bytes=state_cache_bytes, max_logprobs=max_logprobs, backend=backend,
                    enforce_eager=enforce_eager, async_scheduling=async_scheduling)

    @classmethod
    def from_model(cls, model: CausalLM, tokenizer: Any, *, ops: Any = None, eos_token_ids: Seq[int] | None = None,
                   state_cache_bytes: int = 1 << 30, token_masks: TokenMaskProvider | None = None,
                   **limits: Any) -> LLM:
        """An LLM over an already-built model (tests, custom loaders).  ``limits`` as in ``__init__``, plus
        ``backend``: the device services (graph capture, copies); default: the selected backend when it drives
        the model's device type, else the base class (plain copies, no graphs)."""
        from deepinfer.backends import Backend, current_backend
        from deepinfer.ops import OpTable

        envs.check_consistency()
        self = cls.__new__(cls)
        if limits.get("backend") is None:
            try:
                selected = current_backend()
            except Exception:  # noqa: BLE001 - an unusable DEEPINFER_ACCELERATOR: the model still runs
                selected = None
            same = selected is not None and selected.device_type == torch.device(model.device).type
            limits["backend"] = selected if same else Backend()
        eos = tuple(eos_token_ids) if eos_token_ids is not None else _eos_token_ids(None, model, tokenizer)
        self._setup(model, tokenizer, ops if ops is not None else OpTable(), eos, token_masks=token_masks,
                    state_cache_bytes=state_cache_bytes, **limits)
        return self

    def _setup(self, model: CausalLM, tokenizer: Any, ops: Any, eos: tuple[int, ...], *, seed: int = 0,
               max_model_len: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
               state_cache_bytes: int, max_logprobs: int = MAX_LOGPROBS,
               token_masks: TokenMaskProvider | None = None, backend: Any = None,
               enforce_eager: bool = False, async_scheduling: bool = True) -> None:
        if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        capacity = model.configure_state(max_num_seqs, state_cache_bytes)
        if capacity.max_seqs < max_num_seqs:
            logger.info("max_num_seqs lowered to %d: the state cache budget holds that many sequence slots",
                        capacity.max_seqs)
        config = EngineConfig(
            max_model_len=_fit_max_model_len(max_model_len, model, capacity.nbytes),
            state_cache_bytes=capacity.nbytes, max_num_seqs=capacity.max_seqs,
            max_num_batched_tokens=max_num_batched_tokens, seed=seed, max_logprobs=max_logprobs, eos_token_ids=eos,
            enforce_eager=enforce_eager, async_scheduling=async_scheduling,
        )
        self.engine = Engine(model, tokenizer, ops, config, token_masks, backend)
        self._request_ids = itertools.count()

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
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list: list[SamplingParams | None] = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts; "
                                 "pass one SamplingParams or one per prompt")
        with self.engine.lock:
            try:
                return self._run(prompt_list, params_list, use_tqdm)
            except BaseException:
                self.engine.abort_all()  # whatever was interrupted, the next call starts from an empty engine
                raise

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


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The checkpoint's tokenizer through transformers (never ``trust_remote_code``)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.fspath(path), trust_remote_code=False)
    except Exception as exc:
        raise RuntimeError(f"could not load a tokenizer from {os.fspath(path)!r} ({type(exc).__name__}: {exc}); the "
                           "checkpoint directory needs tokenizer.json and tokenizer_config.json") from exc
