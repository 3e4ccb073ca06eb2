"""A running request's outputs sent between ranks as what is new, not all of it again each step.

A data-parallel rank serving a request reports it after every step that gave it tokens; rank 0 hands the server
the whole output so far (what ``Engine.take_updates`` gives on one rank).  Sending it whole each step would
pickle every token again (quadratic in the output length), so the owner sends each completion's new tokens,
logprobs and text after the first report (:class:`DeltaSender`) and rank 0 appends them
(:class:`DeltaReceiver`).  A finished (or failed) request is sent whole, once.  Like ``stream.py``'s deltas, this
relies on a running completion's tokens and text only growing.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class OutputUpdate:
    """One request's news: its whole output (``starts`` None), or per completion only what is new
    (``starts[index]``: the tokens and characters of that completion the receiver already has)."""

    output: RequestOutput
    starts: dict[int, tuple[int, int]] | None = None


class DeltaSender:
    """The owner's side: remembers how much of each running request it has sent."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[int, int]]] = {}

    def encode(self, out: RequestOutput) -> OutputUpdate:
        if out.finished or out.error is not None:
            self._sent.pop(out.request_id, None)
            return OutputUpdate(out)
        sent = self._sent.get(out.request_id)
        self._sent[out.request_id] = {c.index: (len(c.token_ids), len(c.text)) for c in out.outputs}
        if sent is None:
            return OutputUpdate(out)
        starts = {c.index: _start(c, sent.get(c.index, (0, 0))) for c in out.outputs}
        news = [CompletionOutput(c.index, c.text[starts[c.index][1]:], c.token_ids[starts[c.index][0]:],
                                 c.cumulative_logprob,
                                 c.logprobs[starts[c.index][0]:] if c.logprobs is not None else None,
                                 c.finish_reason, c.stop_reason) for c in out.outputs]
        return OutputUpdate(RequestOutput(out.request_id, None, [], None, news, out.finished, out.error, out.metrics,
                                          out.spec_decoding_stats, out.num_cached_tokens), starts)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


def _start(c: CompletionOutput, sent: tuple[int, int]) -> tuple[int, int]:
    """Where ``c``'s news starts; from the beginning should it ever have shrunk."""
    tokens, chars = sent
    return (tokens, chars) if tokens <= len(c.token_ids) and chars <= len(c.text) else (0, 0)


class DeltaReceiver:
    """Rank 0's side: the whole output so far of each running request reported by an owner."""

    def __init__(self) -> None:
        self._have: dict[str, RequestOutput] = {}

    def decode(self, update: OutputUpdate) -> RequestOutput:
        out = update.output
        if update.starts is None:
            if out.finished or out.error is not None:
                self._have.pop(out.request_id, None)
            else:
                self._have[out.request_id] = out
            return out
        have = self._have[out.request_id]
        completions = {c.index: c for c in have.outputs}
        for c in out.outputs:
            tokens, chars = update.starts[c.index]
            whole = completions.get(c.index)
            if whole is None:
                whole = completions[c.index] = CompletionOutput(c.index, "", [], None, None)
                have.outputs.append(whole)
            del whole.token_ids[tokens:]
            whole.token_ids += c.token_ids
            if c.logprobs is not None:
                whole.logprobs = whole.logprobs if whole.logprobs is not None else []
                del whole.logprobs[tokens:]
                whole.logprobs += c.logprobs
            whole.text = whole.text[:chars] + c.text
            whole.cumulative_logprob, whole.finish_reason, whole.stop_reason = (
                c.cumulative_logprob, c.finish_reason, c.stop_reason)
        have.metrics, have.spec_decoding_stats, have.num_cached_tokens = (
            out.metrics, out.spec_decoding_stats, out.num_cached_tokens)
        return have

    def forget(self, request_id: str) -> None:
        self._have.pop(request_id, None)
