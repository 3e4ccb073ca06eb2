"""The engine's structured-output service: matchers for new requests, the step's bitmask on the device.

It fits the sampler's ``TokenMaskProvider`` hook (``token_bitmask(rows, vocab_size, device)``): each
sampled row carries its sequence's :class:`GrammarMatcher` as ``row.grammar`` (``None`` for a free
request).  Everything else the engine does with a matcher is a direct call on it (``accept`` after
sampling, ``is_terminated`` to finish, ``rollback`` for rejected drafts); see
``docs/structured_output.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deepinfer.structured.bitmask import allocate_token_bitmask, fill_token_bitmask
from deepinfer.structured.compiler import GrammarCompiler, grammar_compiler
from deepinfer.structured.matcher import GrammarMatcher
from deepinfer.structured.spec import GrammarSpec


class GrammarMaskProvider:
    """One per engine: compiles ``so_args`` (shared cache per tokenizer) and builds per-step bitmasks."""

    __slots__ = ("compiler",)

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()):
        self.compiler: GrammarCompiler = grammar_compiler(tokenizer, vocab_size, tuple(stop_token_ids) or None)

    @property
    def vocab_size(self) -> int:
        return self.compiler.vocab_size

    def matcher(self, so_args: dict[str, Any] | GrammarSpec) -> GrammarMatcher:
        """A new request's matcher.  ``ValueError`` (bad ``so_args`` or grammar): fail that request alone."""
        return self.compiler.matcher(so_args)

    def token_bitmask(self, rows: Sequence[Any], vocab_size: int, device: torch.device) -> torch.Tensor | None:
        """The bitmask for sampled ``rows`` (each with a ``grammar`` attribute), or ``None`` if none is constrained."""
        return self.bitmask_for([getattr(row, "grammar", None) for row in rows], vocab_size, device)

    def bitmask_for(
        self, grammars: Sequence[GrammarMatcher | None], vocab_size: int, device: torch.device
    ) -> torch.Tensor | None:
        """Fill on the CPU, copy to ``device`` asynchronously; ``None`` when every row is free."""
        if vocab_size != self.vocab_size:
            raise ValueError(f"logits have {vocab_size} columns; grammars were compiled for vocab {self.vocab_size}")
        if all(g is None for g in grammars):
            return None
        # A fresh (pinned, for accelerators) buffer per step: the caching host allocator makes it cheap,
        # and a previous step's asynchronous copy can never see it overwritten.
        device = torch.device(device)
        host = allocate_token_bitmask(len(grammars), vocab_size, pin_memory=device.type != "cpu")
        fill_token_bitmask(grammars, host)
        return host.to(device, non_blocking=True)
