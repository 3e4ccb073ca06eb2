"""One request's progress through its grammar: which tokens may come next, and undo for drafts.

The state is xgrammar's matcher (an Earley parser that keeps the history of every accepted token), so
it can step back any number of accepted tokens.  Speculative decoding uses that directly: mask rows
for a draft are computed by accepting the drafted tokens one by one and then rolling all of them back
(:meth:`GrammarMatcher.fill_draft_bitmasks`); after verification the engine accepts only the tokens
the target model kept.  Nothing is ever committed that has not been verified.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from deepinfer.structured.schema import schema_violation
from deepinfer.structured.spec import GrammarSpec

ALL_ALLOWED = -1  # an int32 word with every bit set


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def token_allowed(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    """Whether bit ``token_id`` of ``bitmask[row]`` is set (bit ``t % 32`` of word ``t // 32``)."""
    if not 0 <= token_id < bitmask.shape[1] * 32:
        return False
    return bool((int(bitmask[row, token_id >> 5]) >> (token_id & 31)) & 1)


class GrammarMatcher:
    """The grammar state of one request.  Not thread-safe; one per request (``fork`` for ``n > 1``)."""

    __slots__ = ("_matcher", "vocab_size", "stop_token_ids", "spec", "_num_accepted")

    def __init__(self, compiled: xgr.CompiledGrammar | None, vocab_size: int, *, spec: GrammarSpec | None = None,
                 _matcher: xgr.GrammarMatcher | None = None):
        if _matcher is None:
            if compiled is None:
                raise ValueError("GrammarMatcher needs a compiled grammar")
            _matcher = xgr.GrammarMatcher(compiled)
        self._matcher = _matcher
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(self._matcher.stop_token_ids)
        #: The request's grammar (``so_args``), when known: names it in errors, and checks JSON output.
        self.spec = spec
        self._num_accepted = 0

    @property
    def label(self) -> str:
        """How errors name the grammar: ``so_args['regex']`` and so on."""
        return f"so_args[{self.spec.kind!r}]" if self.spec is not None else "the grammar"

    @property
    def num_accepted(self) -> int:
        """Tokens accepted and not rolled back: the most :meth:`rollback` can undo."""
        return self._num_accepted

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; ``False`` (state unchanged) if the grammar does not allow it here.

        Accepting a stop token once the grammar is complete terminates the matcher.
        """
        if not 0 <= token_id < self.vocab_size or self._matcher.is_terminated():
            return False
        if not self._matcher.accept_token(int(token_id)):
            return False
        self._num_accepted += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (CPU int32 ``[*, ceil(V/32)]``).

        A terminated matcher allows only its stop tokens, so a step scheduled after termination
        (possible with async scheduling) ends the request again instead of failing.
        """
        if self._matcher.is_terminated():
            bitmask[row].zero_()
            for token in self.stop_token_ids:
                word = int(bitmask[row, token >> 5]) | (1 << (token & 31))
                bitmask[row, token >> 5] = word - (1 << 32) if word >= 1 << 31 else word
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def fill_draft_bitmasks(self, draft_tokens: Sequence[int], bitmask: torch.Tensor, first_row: int) -> int:
        """Mask rows for verifying a draft; the matcher's state is unchanged afterwards.

        Row ``first_row + i`` (``i = 0..len(draft_tokens)``) gets the mask *before* draft token ``i``
        (the last row is for the bonus token).  Returns how many leading draft tokens the grammar
        allows; rows past the first disallowed token can never be used (the target rejects that token
        there) and are left all-allowed so they stay finite.
        """
        num_ok = 0
        for i, token in enumerate(draft_tokens):
            self.fill_bitmask(bitmask, first_row + i)
            if not token_allowed(bitmask, first_row + i, token) or not self.accept(token):
                bitmask[first_row + i + 1 : first_row + len(draft_tokens) + 1] = ALL_ALLOWED
                break
            num_ok += 1
        else:
            self.fill_bitmask(bitmask, first_row + len(draft_tokens))
        self.rollback(num_ok)
        return num_ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected drafts, or a preemption replay)."""
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._num_accepted} accepted")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self._num_accepted -= num_tokens

    def dead_end(self) -> bool:
        """No token of the vocabulary may come next, and the grammar is not finished: nothing can complete it (it
        matches no string with the tokens so far, or only strings this tokenizer cannot spell)."""
        if self._matcher.is_terminated():
            return False
        mask = torch.zeros((1, bitmask_width(self.vocab_size)), dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(mask, 0)
        return not bool(mask.any())

    def output_problem(self, text: str) -> str | None:
        """What is wrong with ``text``, the output of a finished match, beyond what the grammar enforced: for a
        JSON schema, the keywords xgrammar does not enforce (see :mod:`.schema`).  ``None`` when it conforms."""
        if self.spec is None or self.spec.kind != "json_schema":
            return None
        return schema_violation(self.spec.source, text)

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request is finished."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """The tokens so far form a complete match (a stop token may come next)."""
        return self._matcher.is_completed()

    def fork(self) -> GrammarMatcher:
        """An independent copy with the same state and history (one per sample when ``n > 1``)."""
        copy = GrammarMatcher(None, self.vocab_size, spec=self.spec, _matcher=self._matcher.fork())
        copy._num_accepted = self._num_accepted
        return copy
