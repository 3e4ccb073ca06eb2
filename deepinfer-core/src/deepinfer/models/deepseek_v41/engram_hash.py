"""Engram hashing: each token's look-back compressed ids, and the bucket layout they hash into (spec §9.2-9.4).

Per Engram layer, column ``c = (n - 2) * n_heads + h`` (n-gram size n in 2..N, N = ``engram_max_ngram_size``)
has its own prime bucket count; the table rows of a layer are its columns' buckets one after another.  The
primes are the consecutive primes >= ``engram_vocab_size`` taken in (layer, n, head) order, never reused
across layers.  Each layer hashes with N odd multipliers from a generator seeded by its layer id.

The n-gram history is per-sequence state: a chunk needs the compressed ids of the N - 1 tokens before it.
:func:`engram_lookback` builds a ragged step's [T, N] look-back rows from the step's ids and each row's
sequence history; :func:`history_after` reads the next history off them.  Tensor ops only, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from deepinfer.models.config_fields import ConfigError
from deepinfer.models.deepseek_v41.config import DeepseekV41Config

#: Witnesses that make Miller-Rabin exact below 3.3e24 (far beyond any table size).
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(slots=True, frozen=True)
class EngramLayout:
    """Per Engram layer (in ``engram_layer_ids`` order): bucket primes and row offsets per column, multipliers
    per look-back."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int  # N: look-backs 0..N-1, n-gram sizes 2..N
    primes: tuple[tuple[int, ...], ...]  # [layer][column]
    offsets: tuple[tuple[int, ...], ...]  # [layer][column]: first table row of the column's buckets
    multipliers: tuple[tuple[int, ...], ...]  # [layer][look-back]

    @classmethod
    def from_config(cls, cfg: DeepseekV41Config) -> EngramLayout:
        """Raises if a layer's buckets do not add up to its table size ``engram_num_embeddings``."""
        # transformers restarts its search per n-gram order but skips every prime used before, by any layer:
        # the buckets are simply the consecutive primes >= engram_vocab_size
        n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        primes: list[tuple[int, ...]] = []
        candidate = cfg.engram_vocab_size - 1
        for _ in cfg.engram_layer_ids:
            columns: list[int] = []
            for _ in range(n_cols):
                candidate += 1
                while not is_prime(candidate):
                    candidate += 1
                columns.append(candidate)
            primes.append(tuple(columns))
        for layer_id, buckets, rows in zip(cfg.engram_layer_ids, primes, cfg.engram_num_embeddings, strict=True):
            if sum(buckets) != rows:
                raise ConfigError(f"engram_num_embeddings gives layer {layer_id} {rows} rows but its hash buckets "
                                  f"need {sum(buckets)} (primes from engram_vocab_size {cfg.engram_vocab_size})")
        offsets = tuple(tuple(accumulate(buckets[:-1], initial=0)) for buckets in primes)
        bound = max(1, (2**63 - 1) // cfg.engram_compressed_vocab_size // 2)  # id * multiplier < 2^63
        multipliers = tuple(
            tuple(int(v) * 2 + 1 for v in np.random.default_rng(10007 * layer_id).integers(
                0, bound, size=cfg.engram_max_ngram_size, dtype=np.int64))
            for layer_id in cfg.engram_layer_ids)
        return cls(tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size, tuple(primes), offsets, multipliers)

    def hash_tensors(self, index: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        """``(multipliers [N], primes [C], offsets [C])`` int64 of the ``index``-th Engram layer, the last three
        arguments of ``ops.engram_hash``."""
        return tuple(torch.tensor(v, dtype=torch.int64, device=device)
                     for v in (self.multipliers[index], self.primes[index], self.offsets[index]))


def engram_lookback(
    ids: torch.Tensor, positions: torch.Tensor, chunk_starts: torch.Tensor, history: torch.Tensor, pad: int
) -> torch.Tensor:
    """[T, N] int64: column s of row t is the compressed id of the token ``s`` positions before row t's token
    (column 0 is the token itself), ``pad`` where that position is before the sequence's start.

    A ragged step: each sequence's rows are contiguous, at consecutive positions from its ``chunk_start``.
    ids: [T] compressed ids of the step's tokens; positions, chunk_starts: [T] int64 (each row's position and
    its chunk's first position); history: [T, N-1] int64, each row's sequence history: column k is the
    compressed id at position ``chunk_start - 1 - k`` (any value where that is negative).
    """
    rows, n = ids.shape[0], history.shape[1] + 1
    back = torch.arange(n, device=ids.device)
    offset = (positions - chunk_starts).unsqueeze(1)  # the row's index within its chunk
    row = torch.arange(rows, device=ids.device).unsqueeze(1)
    from_chunk = ids[(row - back).clamp(min=0)]
    from_history = history.gather(1, (back - offset - 1).clamp(0, n - 2))
    looked = torch.where(back <= offset, from_chunk, from_history)
    return torch.where(positions.unsqueeze(1) < back, torch.full_like(looked, pad), looked)


def history_after(lookback: torch.Tensor, last_rows: torch.Tensor) -> torch.Tensor:
    """[B, N-1]: each sequence's history for its next chunk, from the look-back rows of its last token in this
    step (``last_rows`` [B]): the ids at positions ``end - 1 - k``, pad before the start.  A new sequence's
    history may hold anything (positions before 0 read as pad)."""
    return lookback[last_rows, :-1]
