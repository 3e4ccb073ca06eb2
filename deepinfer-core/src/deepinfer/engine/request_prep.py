"""Preparing a request off the engine thread: the work that grows with the request, in a small worker pool.

Tokenizing a prompt, checking its token ids and its length, and compiling its grammar take time in proportion to
the request (seconds for a megabyte prompt or a large JSON schema).  ``AsyncLLM`` runs them here before it hands
the request to the engine thread, so a big request delays only itself, never the steps of requests already
running; the server renders chat templates in the same pool.  What comes out is a tokens prompt of at most
``max_model_len`` ids (the engine thread re-checks only those) whose grammar the engine finds compiled in the
shared compiler's cache, or the request's rejected output.  Fast tokenizers release the GIL while they encode.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from deepinfer.engine.engine import Engine, rejected_output
from deepinfer.engine.validation import RequestError, check_prompt_length, normalize_prompt
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Worker threads: one huge request leaves the others to the rest.
NUM_PREP_WORKERS = 4


class RequestPrep:
    """The worker pool and what it does to a request before ``engine`` sees it (see the module docstring)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.pool = ThreadPoolExecutor(NUM_PREP_WORKERS, thread_name_prefix="deepinfer-prep")
        if engine.tokenizer is not None:  # a tokenizer's settings may be fixed on its first call: not concurrently
            engine.tokenizer.encode("warm up")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def prepare(self, prompt: Any, params: SamplingParams, request_id: str,
                arrival_time: float) -> dict[str, Any] | RequestOutput:
        """(In a worker.)  ``prompt`` as a checked tokens prompt, its grammar compiled; or its rejected output."""
        try:
            text, ids = normalize_prompt(prompt, self.engine.tokenizer)
            check_prompt_length(ids, self.engine.config.max_model_len)
            self._compile_grammar(params)
        except RequestError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - as Engine.add_request: whatever fails fails this request alone
            logger.warning("request %s could not be prepared", request_id, exc_info=True)
            error = f"could not prepare the request ({type(exc).__name__}: {exc})"
        else:
            return {"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids}
        logger.warning("request %s rejected: %s", request_id, error)
        return rejected_output(request_id, prompt, error, arrival_time)

    def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile ``so_args`` in the grammar compiler the engine's mask provider shares (thread-safe, cached);
        an invalid grammar is refused here, with the engine's message."""
        engine = self.engine
        if not isinstance(params.so_args, dict) or engine.tokenizer is None:
            return
        from deepinfer.structured import GrammarMaskProvider

        masks = engine.token_masks
        if masks is None:  # the one the engine builds on first use
            masks = GrammarMaskProvider(engine.tokenizer, engine.model.vocab_size, engine.config.eos_token_ids)
        if isinstance(masks, GrammarMaskProvider):  # (a provider of the caller's own compiles on the engine thread)
            try:
                masks.compiler.compile(params.so_args)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
