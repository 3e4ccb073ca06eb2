"""How many slots and pages a byte budget buys: pure functions of a :class:`~.spec.StateSpec`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.kv.spec import StateSpec, ceil_div


@dataclass(slots=True, frozen=True)
class PoolPlan:
    slots: int  # including the null slot 0
    pages: dict[int, int]  # per ratio, including the null page 0
    admissible: int  # bytes of state_bytes() the scheduler may reserve in all
    nbytes: int  # bytes the pool allocates


def _plan_admitting(spec: StateSpec, size: int, live: int, admissible: int) -> PoolPlan:
    """The pool for at most ``live`` sequences whose ``state_bytes`` sum to at most ``admissible``.

    Any such set fits: each holds a slot, and per ratio the pages of ``T`` tokens in all plus one partly filled
    page per sequence, where ``T`` bounds the tokens that many reserved bytes can describe (entries are
    ``floor(n / ratio)``, hence the slack).  Its ``nbytes`` is monotone in ``admissible``."""
    ratios = spec.paged_ratios
    slot_bytes, page_bytes = spec.byte_sizes(size)
    pages: dict[int, int] = {}
    if ratios:
        per_token = sum(page_bytes[r] / (r * spec.page_size) for r in ratios)
        slack_tokens = live * sum(page_bytes[r] / spec.page_size for r in ratios) / per_token
        tokens = int(admissible / per_token + slack_tokens) + 1
        pages = {r: ceil_div(tokens, r * spec.page_size) + live + 1 for r in ratios}
    nbytes = (live + 1) * slot_bytes + sum(n * page_bytes[r] for r, n in pages.items())
    return PoolPlan(live + 1, pages, admissible, nbytes)


def _least_admissible(spec: StateSpec, size: int) -> int:
    """What a usable pool admits at least: one sequence of 2 tokens (the shortest ``max_model_len``)."""
    return max(spec.byte_sizes(size)[0], spec.state_bytes(2, size))


def _least_capacity(spec: StateSpec, size: int, live: int) -> int:
    """The least budget a pool of ``live`` slots is usable in."""
    return _plan_admitting(spec, size, live, _least_admissible(spec, size)).nbytes


def _plan_for(spec: StateSpec, size: int, live: int, capacity: int) -> PoolPlan | None:
    """The pool for at most ``live`` sequences within ``capacity`` bytes admitting the most bytes (a binary
    search: ``nbytes`` is monotone in them, so this never falls as ``capacity`` grows), or None if unusable."""
    lo, hi = _least_admissible(spec, size), capacity  # the answer is in [lo, hi] if lo fits
    if _plan_admitting(spec, size, live, lo).nbytes > capacity:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _plan_admitting(spec, size, live, mid).nbytes <= capacity else (lo, mid - 1)
    return _plan_admitting(spec, size, live, lo)


def _fixed_bytes(spec: StateSpec, size: int) -> int:
    """What a slot costs before its tokens: the slot and a partly filled page per ratio."""
    slot_bytes, page_bytes = spec.byte_sizes(size)
    return max(1, slot_bytes + sum(page_bytes.values()))


def _slots_for(spec: StateSpec, size: int, max_seqs: int, capacity: int) -> int:
    """Sequence slots for ``capacity`` bytes (0: unusable): at most ``max_seqs``, their fixed costs at most half
    the budget, and no more than leave the pool usable."""
    live = max(1, min(max_seqs, capacity // (2 * _fixed_bytes(spec, size))))
    while live > 0 and _least_capacity(spec, size, live) > capacity:
        live -= 1
    return live


def _try_plan(spec: StateSpec, size: int, max_seqs: int, capacity: int) -> PoolPlan | None:
    """The pool for ``capacity`` bytes with :func:`_slots_for`'s slots, monotone in ``capacity``: more bytes never
    give fewer slots or admit fewer bytes.  A budget below the one where the next slot comes admits no more than
    that one will (the slot costs bytes the budget has not grown by), so the bytes past that level stay
    unallocated."""
    live = _slots_for(spec, size, max_seqs, capacity)
    if live == 0:
        return None
    plan = _plan_for(spec, size, live, capacity)
    assert plan is not None
    if live == max_seqs:
        return plan
    # the least budget with more slots: both of _slots_for's bounds are monotone step functions
    next_at = max(2 * _fixed_bytes(spec, size) * (live + 1), _least_capacity(spec, size, live + 1))
    level = _plan_for(spec, size, live + 1, next_at)
    assert level is not None
    return plan if level.admissible >= plan.admissible else _plan_admitting(spec, size, live, level.admissible)


def plan_pool(spec: StateSpec, size: int, max_seqs: int, capacity: int) -> PoolPlan:
    """The pool for ``capacity`` bytes at ``size`` bytes per element of the model's dtype: at most ``max_seqs``
    slots, fewer when their fixed cost (a slot and a partly filled page per ratio each) would take more than half
    the budget; the rest holds pages."""
    plan = _try_plan(spec, size, max_seqs, capacity)
    if plan is None:
        raise ValueError(f"a state cache budget of {capacity} bytes cannot hold one sequence of this model (its "
                         "slot and pages, and the pool's null slot and pages): raise state_cache_bytes to at least "
                         f"{min_pool_bytes(spec, size, max_seqs)}")
    return plan


def _smallest(enough: Callable[[int], bool], start: int, per_mille: int) -> int:
    """The smallest budget ``enough`` accepts, within ``per_mille`` thousandths (0: to the byte), searching up
    from ``start``; the value returned is one ``enough`` accepted.  ``enough`` must be monotone."""
    lo, hi = 0, max(1, start)
    while not enough(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > max(1, hi * per_mille // 1000):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def pool_bytes_for(spec: StateSpec, size: int, max_seqs: int, num_tokens: int, sequences: int | None = None,
                   per_mille: int = 1) -> int:
    """The smallest budget (within ``per_mille`` thousandths) whose :func:`plan_pool` for at most ``max_seqs``
    slots admits ``sequences`` (default ``max_seqs``) sequences of ``num_tokens`` tokens each."""
    n = max_seqs if sequences is None else sequences
    want = n * spec.state_bytes(num_tokens, size)

    def enough(capacity: int) -> bool:
        plan = _try_plan(spec, size, max_seqs, capacity)
        return plan is not None and plan.slots - 1 >= n and plan.admissible >= want

    return _smallest(enough, 2 * want, per_mille)


def min_pool_bytes(spec: StateSpec, size: int, max_seqs: int = 1 << 31) -> int:
    """The smallest budget (to the byte) that holds one sequence of 2 tokens, the shortest ``max_model_len``, with
    at most ``max_seqs`` slots: the least ``state_cache_bytes`` an engine of that ``max_num_seqs`` accepts."""
    return pool_bytes_for(spec, size, max_seqs, 2, sequences=1, per_mille=0)


#: The sequence length :func:`tokens_per_gib` reports at (the default state budget's, ``EngineArgs``).
REPORT_TOKENS = 8192


def tokens_per_gib(spec: StateSpec, size: int, num_tokens: int = REPORT_TOKENS) -> float:
    """Tokens of context one GiB of state holds in sequences of ``num_tokens`` tokens (their slots and pages)."""
    return (1 << 30) * num_tokens / spec.state_bytes(num_tokens, size)


def describe_density(spec: StateSpec, size: int) -> str:
    """One line for the log: tokens of context per GiB as stored, and in the model's dtype if some rows are
    packed."""
    stored, plain = tokens_per_gib(spec, size), tokens_per_gib(spec.unpacked(), size)
    line = f"{stored:,.0f} tokens of context per GiB of state ({REPORT_TOKENS}-token sequences)"
    return line if stored == plain else line + f"; {plain:,.0f} with every row in the model's dtype"
