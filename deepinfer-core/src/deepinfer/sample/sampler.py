"""The sampler: penalties, bans, grammar mask, truncation and a seeded draw, each an op of the table.

Every step is row-wise, so a request's token depends only on its own logits, parameters, seed and
output position, never on its batch neighbours.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, Protocol

import torch

from deepinfer.ops import Ops
from deepinfer.step import SamplingRow

__all__ = ["Sampler", "SamplingRow", "TokenMaskProvider", "signed64", "token_table"]

_U64 = 1 << 64


class TokenMaskProvider(Protocol):
    """Hook for structured output (``deepinfer.structured.GrammarMaskProvider`` is the implementation).

    ``matcher(so_args)`` starts a request's grammar (``ValueError``: reject the request); per step,
    ``token_bitmask`` gives the allowed tokens of each row (xgrammar layout), or ``None``.
    """

    def matcher(self, so_args: Any) -> Any:
        """A new grammar matcher (a ``deepinfer.structured.GrammarMatcher``: the engine calls ``accept(token)``,
        ``is_terminated()``, ``fork()``, ``dead_end()``, ``output_problem(text)`` and reads ``label``)."""
        ...

    def token_bitmask(self, rows: Seq[SamplingRow], vocab_size: int, device: torch.device) -> torch.Tensor | None:
        """int32 ``[len(rows), ceil(vocab_size / 32)]``; rows without a grammar allow every token."""
        ...


def signed64(seed: int) -> int:
    """A 64-bit seed as the int64 with the same bits."""
    seed %= _U64
    return seed - _U64 if seed >= 1 << 63 else seed


def token_table(rows: list[list[int]], vocab_size: int, device: torch.device,
                upload: Callable[[torch.Tensor, torch.device], torch.Tensor]) -> torch.Tensor:
    """Occurrence counts ``[len(rows), vocab_size]`` int32 of each row's token ids."""
    width = max((len(r) for r in rows), default=0)
    padded = torch.full((len(rows), max(width, 1)), vocab_size, dtype=torch.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    padded = upload(padded, device)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab_size]


class Sampler:
    """Draws one token per row of fp32 logits ``[N, V]``."""

    def __init__(self, ops: Ops, eos_token_ids: Seq[int] = (),
                 upload: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None):
        self.ops = ops
        self.eos_token_ids = tuple(eos_token_ids)
        #: Host-to-device copy of the per-row parameters (the backend's non-blocking ``to_device``): a plain
        #: ``torch.tensor(..., device=cuda)`` would wait for the queued step, and undo async scheduling.
        self.upload = upload if upload is not None else (lambda t, device: t.to(device))

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], token_bitmask: torch.Tensor | None = None,
        inflight: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Token ids int64 ``[N]`` on the logits' device.  ``inflight`` = (rows, tokens) on the device: the
        token each of those rows has sampled but ``output_ids`` does not hold yet (async scheduling); the
        penalties count it."""
        return self.draw(self.distribution(logits, rows, token_bitmask, inflight), rows)

    def distribution(
        self, logits: torch.Tensor, rows: list[SamplingRow], token_bitmask: torch.Tensor | None = None,
        inflight: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The logits each row draws from, fp32 ``[N, V]``: penalties, bans and the grammar mask applied; rows that
        sample also tempered and truncated (their softmax is the distribution drawn from), greedy rows not (their
        argmax is the token).  What speculative verification compares drafts with."""
        device = logits.device
        vocab = logits.shape[-1]
        params = [r.params for r in rows]
        x = logits

        if any(p.has_penalties for p in params):
            output_counts = token_table([r.output_ids for r in rows], vocab, device, self.upload)
            if inflight is not None:
                ones = torch.ones_like(inflight[0], dtype=output_counts.dtype)
                output_counts.index_put_(inflight, ones, accumulate=True)  # one (row, token) each: no collision
            x = self.ops.apply_penalties(
                x,
                token_table([r.prompt_ids for r in rows], vocab, device, self.upload) > 0,
                output_counts,
                self._to([p.presence_penalty for p in params], torch.float32, device),
                self._to([p.frequency_penalty for p in params], torch.float32, device),
                self._to([p.repetition_penalty for p in params], torch.float32, device),
            )

        banned = [self._banned_until_min_tokens(r) for r in rows]
        if any(banned):
            mask = torch.zeros(len(rows), vocab, dtype=torch.bool)
            for i, ids in enumerate(banned):
                mask[i, [t for t in ids if t < vocab]] = True
            x = x.masked_fill(self.upload(mask, device), float("-inf"))

        if token_bitmask is not None:
            x = self.ops.apply_token_bitmask(x, token_bitmask)

        x = x.float()
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if drawn:  # only the rows that sample pay for truncation
            ps = [params[i] for i in drawn]
            index = self._to(drawn, torch.int64, device)
            temperature = self._to([p.temperature for p in ps], torch.float32, device)
            xs = x[index] / temperature[:, None]  # rows without top-k / top-p / min-p: only this
            cut = [j for j, p in enumerate(ps) if p.truncates]
            if cut:  # per row, so a row's logits never depend on whether its neighbours truncate
                pc = [ps[j] for j in cut]
                at = self._to(cut, torch.int64, device)
                xs[at] = self.ops.filter_logits(
                    x[index[at]],
                    temperature[at],
                    self._to([p.top_k for p in pc], torch.int64, device),
                    self._to([p.top_p for p in pc], torch.float32, device),
                    self._to([p.min_p for p in pc], torch.float32, device),
                )
            x = x.index_copy(0, index, xs)
        return x

    def draw(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row of :meth:`distribution`'s logits: the argmax of greedy rows, a seeded draw
        (``sample_tokens``: noise of the row's seed and output position) of the others."""
        device = x.device
        tokens = x.argmax(dim=-1)
        drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
        if drawn:
            rs = [rows[i] for i in drawn]
            index = self._to(drawn, torch.int64, device)
            tokens[index] = self.ops.sample_tokens(
                x[index],
                self._to([False] * len(drawn), torch.bool, device),
                self._to([signed64(r.seed) for r in rs], torch.int64, device),
                self._to([r.step for r in rs], torch.int64, device),
            )
        return tokens

    def _to(self, values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.upload(torch.tensor(values, dtype=dtype), device)

    def _banned_until_min_tokens(self, row: SamplingRow) -> list[int]:
        """EOS and stop tokens may not end the output before ``min_tokens`` tokens.

        Not under a grammar: a completed grammar allows only stop tokens, and banning them would leave none.
        """
        p = row.params
        if row.step >= p.min_tokens or row.grammar is not None:
            return []
        return (list(self.eos_token_ids) if not p.ignore_eos else []) + list(p.stop_token_ids or ())
