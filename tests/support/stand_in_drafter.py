"""A drafter that proposes tokens of its own, for testing the engine side of speculative decoding.

Modes: ``random`` (tokens from a random distribution per position, drawn with a generator of the request's seed
and anchor position when it samples, so seeded runs draft the same), ``oracle`` (the tokens a plain run produced:
perfect drafts), ``mixed`` (the oracle, with some drafts replaced by random ones).  It ignores features but
records what the engine extends, forks and frees, by sequence state, so tests can check the drafter's view of each
sequence.
"""

from __future__ import annotations

import torch

from deepinfer.models.base import SequenceState
from deepinfer.spec_decode.drafter import DraftRequest, Drafts

_GOLDEN = 0x9E3779B97F4A7C15


class StandInDrafter:
    capture_layer_ids: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, max_draft_len: int = 4, mode: str = "random",
                 oracle: list[list[int]] | None = None, seed: int = 0, wrong_every: int = 3):
        if mode not in ("random", "oracle", "mixed"):
            raise ValueError(f"mode must be random, oracle or mixed, got {mode!r}")
        if mode != "random" and not oracle:
            raise ValueError("oracle and mixed modes need the plain run's sequences (prompt + output)")
        self.vocab_size, self.max_draft_len, self.mode = vocab_size, max_draft_len, mode
        self.oracle = oracle or []
        self.wrong_every = wrong_every
        self.gen = torch.Generator().manual_seed(seed)
        self.bound: dict[SequenceState, list[int]] = {}  # state -> the oracle sequence it follows
        self.context: dict[SequenceState, list[int]] = {}  # state -> positions extended, in order
        self.calls = 0

    # --- the Drafter protocol ----------------------------------------------------------------------
    def extend(self, states: list[SequenceState], positions: torch.Tensor, features: torch.Tensor) -> None:
        assert features.shape[0] == len(states) == positions.shape[0]
        for state, pos in zip(states, positions.tolist(), strict=True):
            held = self.context.setdefault(state, [])
            del held[pos:]  # a position fed again after a rollback replaces what followed it
            assert len(held) == pos, f"extended position {pos} after {len(held)} positions"
            held.append(pos)

    def draft(self, requests: list[DraftRequest], k: int) -> Drafts:
        self.calls += 1
        b, v = len(requests), self.vocab_size
        tokens = torch.zeros(b, k, dtype=torch.int64)
        for i, r in enumerate(requests):
            gen = self.gen
            if r.temperature > 0:
                gen = torch.Generator().manual_seed((r.seed + (r.position + 1) * _GOLDEN) % (1 << 63))
            for j in range(k):
                q = torch.softmax(torch.randn(v, generator=self.gen) * 2.0, dim=-1)
                guess = self._oracle(r, j)
                if guess is not None and not (self.mode == "mixed" and (r.position + j) % self.wrong_every == 0):
                    # mostly the guess, sometimes not (a sampled draft); the guess itself (a greedy one)
                    q = 0.2 * q + 0.8 * torch.nn.functional.one_hot(torch.tensor(guess), v)
                    if r.temperature == 0:
                        q = torch.nn.functional.one_hot(torch.tensor(guess), v).float()
                tokens[i, j] = int(torch.multinomial(q, 1, generator=gen)) if r.temperature > 0 else int(q.argmax())
        confidence = torch.rand(b, k, generator=self.gen)
        return Drafts(tokens, confidence)

    def truncate(self, state: SequenceState, length: int) -> None:
        del self.context.setdefault(state, [])[length:]

    def fork(self, src: SequenceState, dst: SequenceState) -> None:
        self.context[dst] = list(self.context.get(src, []))
        if src in self.bound:
            self.bound[dst] = self.bound[src]

    def free(self, state: SequenceState) -> None:
        self.context.pop(state, None)
        self.bound.pop(state, None)

    # --- the oracle ----------------------------------------------------------------------------------
    def _oracle(self, r: DraftRequest, j: int) -> int | None:
        if self.mode == "random":
            return None
        seq = self.bound.get(r.state)
        if seq is None or r.position >= len(seq) or seq[r.position] != r.anchor:
            found = [s for s in self.oracle if r.position < len(s) and s[r.position] == r.anchor]
            if not found:
                return None
            seq = self.bound[r.state] = found[0]
        at = r.position + 1 + j
        return seq[at] if at < len(seq) else None
