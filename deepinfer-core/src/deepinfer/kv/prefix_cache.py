"""Prefix caching over the state pool: the compressed entries of prompt prefixes, shared by block.

What is cached: for each block of ``block_size`` prompt tokens (a multiple of every compression ratio), the pages
that hold the compressed entries and indexer keys of the prefix ending with that block (V4.1: its groups' KV
pages) -- the pool's pages, reference-counted, never copied.  Blocks are content-addressed as a chain: a block's
key hashes its parent's key and its own token ids (vLLM's block hashes), and a hit compares the tokens too.

What is not cached: SWA rings, compressor carry-over and Engram history.  A hit of ``C`` tokens gives a new
sequence the shared pages (the last partly filled page copied, :meth:`StatePool.attach`) and starts it at a
replay position ``R < C`` (``PooledCausalLM.replay_start``): the tokens ``R .. C - 1`` run through the model
again to rebuild each layer's ring, the unfinished window and the n-gram history, while the windows they close
are written to the null page instead of over the shared entries (``PooledState.cached_tokens``).  Hits are at
block boundaries, which every ratio divides, so a hit never splits a window the cache would have to restore.

Eviction: the cache holds pages only while the pool has some to spare; a fixed pool that runs out asks
:meth:`PrefixCache.evict` (least recently used leaf block first) before it fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deepinfer.kv.pool import PooledState, StatePool

#: Tokens per block at the least (a block is also a multiple of every compression ratio).
MIN_BLOCK = 16


def block_size_for(ratios: tuple[int, ...]) -> int:
    """The least common multiple of ``MIN_BLOCK`` and every compression ratio."""
    return math.lcm(MIN_BLOCK, *ratios)


@dataclass(slots=True, eq=False)
class CachedBlock:
    """One block of a cached prefix: its tokens, the prefix's pages (held), its place in the chain."""

    key: int
    tokens: tuple[int, ...]
    parent: CachedBlock | None
    end: int  # tokens of the prefix this block ends
    pages: dict[int, list[int]]
    children: int = 0
    last_used: int = 0


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters for the hit rate: prompt tokens of the sequences admitted after a lookup, and the cached tokens
    they started from (a hit the scheduler could not use, or a lookup of a sequence that kept waiting, is not
    counted: the engine records a lookup when its sequence is scheduled)."""

    queries: int = 0
    query_tokens: int = 0
    hits: int = 0
    hit_tokens: int = 0

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        self.queries += 1
        self.query_tokens += query_tokens
        self.hits += bool(hit_tokens)
        self.hit_tokens += hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(slots=True)
class PrefixCache:
    """Blocks of prompt prefixes over ``pool``'s pages (see the module docstring)."""

    pool: StatePool
    block_size: int
    blocks: dict[int, CachedBlock] = field(default_factory=dict)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _clock: int = 0

    def __post_init__(self) -> None:
        self.pool.reclaim = self.evict

    def _chain(self, tokens: list[int], limit: int) -> list[CachedBlock]:
        """The cached blocks of ``tokens``' prefix, at most ``limit`` tokens, from the first block on."""
        chain: list[CachedBlock] = []
        parent: CachedBlock | None = None
        for end in range(self.block_size, limit + 1, self.block_size):
            block_tokens = tuple(tokens[end - self.block_size : end])
            block = self.blocks.get(hash((parent.key if parent else 0, block_tokens)))
            if block is None or block.parent is not parent or block.tokens != block_tokens:
                break
            chain.append(block)
            parent = block
        return chain

    def match(self, tokens: list[int], limit: int) -> int:
        """Tokens of the longest cached prefix of ``tokens`` within ``limit`` (a multiple of the block size, or
        0); marks its blocks used."""
        chain = self._chain(tokens, limit)
        self._clock += 1
        for block in chain:
            block.last_used = self._clock
        return chain[-1].end if chain else 0

    def attach(self, state: PooledState, tokens: list[int], hit: int, start: int) -> None:
        """Give the empty ``state`` the cached entries of ``tokens[:hit]`` and place it at the replay start."""
        chain = self._chain(tokens, hit)
        if not chain or chain[-1].end != hit:
            raise RuntimeError(f"prefix cache: the {hit} tokens matched are no longer cached")
        self.pool.attach(state, chain[-1].pages, hit)
        state.num_tokens = start

    def publish(self, state: PooledState, tokens: list[int], upto: int) -> None:
        """Cache the blocks of ``tokens[:upto]`` whose entries ``state`` holds (its step is queued)."""
        chain = self._chain(tokens, upto)
        parent = chain[-1] if chain else None
        start = parent.end if parent else 0
        self._clock += 1
        for end in range(start + self.block_size, upto + 1, self.block_size):
            block_tokens = tuple(tokens[end - self.block_size : end])
            key = hash((parent.key if parent else 0, block_tokens))
            if key in self.blocks:  # a hash collision with another chain: leave that one be
                return
            pages = {r: state.pages[r][: self.pool.spec.pages_for(end, r)] for r in self.pool.ratios}
            for r, ids in pages.items():
                self.pool.retain(r, ids)
            block = CachedBlock(key, block_tokens, parent, end, pages, last_used=self._clock)
            self.blocks[key] = block
            if parent is not None:
                parent.children += 1
            parent = block

    def evict(self) -> bool:
        """Drop the least recently used block that no other block extends; False when nothing is cached."""
        leaves = [b for b in self.blocks.values() if not b.children]
        if not leaves:
            return False
        block = min(leaves, key=lambda b: b.last_used)
        del self.blocks[block.key]
        if block.parent is not None:
            block.parent.children -= 1
        for r, ids in block.pages.items():
            self.pool.drop(r, ids)
        return True

    def clear(self) -> None:
        while self.evict():
            pass

    def __len__(self) -> int:
        return len(self.blocks)
