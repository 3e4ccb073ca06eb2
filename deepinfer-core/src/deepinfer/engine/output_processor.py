"""Apply sampled tokens to sequences: append, detokenize, check stop conditions, build outputs.

Stop rules (vLLM's): before ``min_tokens`` output tokens only the length limits apply.  Then EOS
(unless ``ignore_eos``) and ``stop_token_ids`` finish with ``"stop"``, as does a structured-output
grammar that has accepted its stop token (whatever ``min_tokens``); the stop token stays in
``token_ids`` but adds no text.  A stop string finishes with ``"stop"`` and the text is cut before it
(or after it with ``include_stop_str_in_output``).  Reaching ``max_tokens`` or ``max_model_len``
finishes with ``"length"``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from deepinfer.engine.detokenizer import IncrementalDetokenizer, find_stop
from deepinfer.engine.request import Request, Sequence
from deepinfer.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from deepinfer.step import TokenLogprobs

if TYPE_CHECKING:
    from deepinfer.structured.matcher import GrammarMatcher


class OutputProcessor:
    """Owns the text side of generation; knows nothing of tensors or scheduling."""

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else ""

    def _position_logprobs(self, tl: TokenLogprobs) -> PositionLogprobs:
        entries = {tid: Logprob(lp, rank, self._token_text(tid)) for rank, (tid, lp) in enumerate(tl.top, start=1)}
        entries[tl.token_id] = Logprob(tl.logprob, tl.rank, self._token_text(tl.token_id))
        return entries

    # --- per step -----------------------------------------------------------------------------
    def record_prompt_logprobs(self, request: Request, position: int, tl: TokenLogprobs) -> None:
        """Store the logprobs of prompt token ``position`` (steps deliver positions in order, once)."""
        recorded = request.prompt_logprobs
        if recorded is not None and position == len(recorded):
            recorded.append(self._position_logprobs(tl))

    def append_token(self, seq: Sequence, tl: TokenLogprobs) -> bool:
        """Add one sampled token to ``seq``; return whether the sequence is now finished.  A sequence that
        fails (its grammar can go no further, or its output breaks its JSON schema) sets ``request.error``."""
        params = seq.request.params
        out = seq.output
        if out is None:
            out = seq.output = CompletionOutput(seq.index, "", [], 0.0, [] if params.logprobs is not None else None)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.request.prompt_token_ids,
                                                     params.skip_special_tokens) if self.tokenizer else None
        token = tl.token_id
        grammar = seq.grammar
        if grammar is not None and not grammar.accept(token):  # drawn under an empty mask: nothing was allowed
            seq.request.error = self._grammar_failure(seq, grammar, token)
            out.finish_reason = "stop"
            return True
        seq.token_ids.append(token)
        out.token_ids.append(token)
        out.cumulative_logprob = (out.cumulative_logprob or 0.0) + tl.logprob
        if out.logprobs is not None:
            out.logprobs.append(self._position_logprobs(tl))

        # A grammar that accepted a stop token is complete; nothing more is allowed.
        grammar_done = grammar is not None and grammar.is_terminated()
        may_stop = seq.num_output >= params.min_tokens
        if grammar_done or (may_stop and not params.ignore_eos and token in self.eos_token_ids):
            out.finish_reason = "stop"
            out.stop_reason = None if token in self.eos_token_ids else token
        elif may_stop and params.stop_token_ids and token in params.stop_token_ids:
            out.finish_reason, out.stop_reason = "stop", token
        else:
            self._add_text(seq, out, token, may_stop)
        if out.finish_reason is None and len(seq.token_ids) >= seq.request.max_total_tokens:
            out.finish_reason = "length"
        if out.finish_reason is not None and not isinstance(out.stop_reason, str) and seq.detokenizer is not None:
            seq.detokenizer.flush()  # no more tokens will complete a held-back partial character
            out.text = seq.detokenizer.text
        if grammar_done and grammar is not None:
            problem = grammar.output_problem(out.text)
            if problem is not None:
                seq.request.error = (f"the output does not satisfy {grammar.label} ({problem}); the grammar "
                                     "xgrammar built from it does not enforce that part of the schema")
        return out.finish_reason is not None

    @staticmethod
    def _grammar_failure(seq: Sequence, grammar: GrammarMatcher, token: int) -> str:
        if grammar.dead_end():
            text = seq.output.text if seq.output is not None else ""
            return (f"{grammar.label} admits no output here: no token can continue it after {seq.num_output} "
                    f"output tokens ({text!r}); it matches no string that starts so, or only strings this "
                    "tokenizer cannot spell")
        return f"internal error: {grammar.label} rejected sampled token {token}"

    def _add_text(self, seq: Sequence, out: CompletionOutput, token: int, may_stop: bool) -> None:
        if seq.detokenizer is None:
            return
        new = seq.detokenizer.add(token)
        out.text = seq.detokenizer.text
        params = seq.request.params
        if not (new and may_stop and params.stop_strings):
            return
        hit = find_stop(out.text, len(new), params.stop_strings)
        if hit is not None:
            idx, stop = hit
            out.text = out.text[: idx + len(stop) if params.include_stop_str_in_output else idx]
            out.finish_reason, out.stop_reason = "stop", stop

    # --- results --------------------------------------------------------------------------------
    @staticmethod
    def request_output(request: Request) -> RequestOutput:
        """The request's result; a request that failed while running has ``error`` and no outputs, like one
        rejected before it ran (no partial output passes for a result)."""
        outputs = []
        for seq in request.sequences if request.error is None else ():
            out = seq.output or CompletionOutput(seq.index, "", [], 0.0, None)
            outputs.append(out)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=request.prompt_logprobs,
            outputs=outputs,
            num_cached_tokens=request.sequences[0].num_cached if request.sequences else 0,
            finished=request.finished,
            error=request.error,
            spec_decoding_stats=request.spec_stats,
            metrics=request.metrics,
        )
