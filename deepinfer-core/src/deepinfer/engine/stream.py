"""Incremental outputs: turn a request's successive outputs into what its ``output_kind`` asks for (vLLM's).

The engine reports a streaming request after every step that gave it tokens (``Engine.take_updates``), with
the live completion objects; :class:`OutputStream` turns each report into a ``CUMULATIVE`` copy, a ``DELTA``
(only the tokens, text and logprobs not sent before) or nothing until the end (``FINAL_ONLY``).

Text that may still be cut by a stop string is held back: while a completion runs, its last
``max(len(stop)) - 1`` characters are not sent (unless ``include_stop_str_in_output``, where a stop never
removes text already produced), so a delta never carries text the final output does not have.
"""

from __future__ import annotations

from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import RequestOutputKind, SamplingParams


class OutputStream:
    """The outputs one consumer of one request sees; keeps what was already sent, per completion."""

    __slots__ = ("kind", "_holdback", "_sent", "_sent_prompt_logprobs")

    def __init__(self, params: SamplingParams):
        self.kind = params.output_kind
        stops = params.stop_strings if not params.include_stop_str_in_output else ()
        self._holdback = max((len(s) for s in stops), default=1) - 1
        #: completion index -> (tokens sent, characters sent, whether its finish was sent)
        self._sent: dict[int, tuple[int, int, bool]] = {}
        self._sent_prompt_logprobs = False

    def next(self, out: RequestOutput) -> RequestOutput | None:
        """What to hand the consumer for ``out`` (``None``: nothing new to say)."""
        if out.finished or out.error is not None:
            if self.kind is not RequestOutputKind.DELTA:
                return out
        elif self.kind is RequestOutputKind.FINAL_ONLY:
            return None
        completions = [c for c in (self._completion(c) for c in out.outputs) if c is not None]
        if not completions and not out.finished:
            return None
        prompt_logprobs = out.prompt_logprobs
        if self.kind is RequestOutputKind.DELTA:
            prompt_logprobs = None if self._sent_prompt_logprobs else prompt_logprobs
            self._sent_prompt_logprobs = True
        return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, prompt_logprobs, completions,
                             out.finished, out.error, out.metrics, out.spec_decoding_stats,
                             out.num_cached_tokens)

    def _completion(self, c: CompletionOutput) -> CompletionOutput | None:
        """A copy of ``c`` cut to what may be sent (DELTA: minus what was sent); ``None`` for an empty delta."""
        end = len(c.text) if c.finish_reason is not None else max(len(c.text) - self._holdback, 0)
        if self.kind is not RequestOutputKind.DELTA:
            return CompletionOutput(c.index, c.text[:end], list(c.token_ids), c.cumulative_logprob,
                                    list(c.logprobs) if c.logprobs is not None else None, c.finish_reason,
                                    c.stop_reason)
        tokens, chars, done = self._sent.get(c.index, (0, 0, False))
        end = max(end, chars)
        finishing = c.finish_reason is not None and not done
        if tokens == len(c.token_ids) and chars == end and not finishing:
            return None
        self._sent[c.index] = (len(c.token_ids), end, c.finish_reason is not None)
        return CompletionOutput(c.index, c.text[chars:end], c.token_ids[tokens:], c.cumulative_logprob,
                                c.logprobs[tokens:] if c.logprobs is not None else None, c.finish_reason,
                                c.stop_reason)
