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


def _plan_for(spec: StateSpec, size: int, live: int, capacity: int) -> PoolPlan | None:
    """The pool for at most ``live`` sequences within ``capacity`` bytes, or None if it does not fit.

    Any set of at most ``live`` sequences whose ``state_bytes`` sum to at most ``admissible`` fits: each holds
    a slot, and per ratio the pages of ``T`` tokens in all plus one partly filled page per sequence, where ``T``
    bounds the tokens that many reserved bytes can describe (entries are ``floor(n / ratio)``, hence the slack).
    """
    ratios = spec.paged_ratios
    slot_bytes, page_bytes = spec.byte_sizes(size)
    per_token = sum(page_bytes[r] / (r * spec.page_size) for r in ratios)
    slack_tokens = live * sum(page_bytes[r] / spec.page_size for r in ratios) / per_token if ratios else 0.0

    def pages_for(admissible: int) -> dict[int, int]:
        tokens = int(admissible / per_token + slack_tokens) + 1 if ratios else 0
        return {r: ceil_div(tokens, r * spec.page_size) + live + 1 for r in ratios}

    def total(admissible: int) -> int:
        return (live + 1) * slot_bytes + sum(n * page_bytes[r] for r, n in pages_for(admissible).items())

    admissible = capacity - total(0)
    while admissible > 0 and total(admissible) > capacity:
        admissible -= max(1, total(admissible) - capacity)
    if admissible < slot_bytes or admissible <= 0:
        return None
    return PoolPlan(live + 1, pages_for(admissible), admissible, total(admissible))


def _try_plan(spec: StateSpec, size: int, max_seqs: int, capacity: int) -> PoolPlan | None:
    slot_bytes, page_bytes = spec.byte_sizes(size)
    fixed = slot_bytes + sum(page_bytes.values())
    live = max(1, min(max_seqs, capacity // (2 * max(1, fixed))))
    return _plan_for(spec, size, live, capacity)


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
    from ``start``; the value returned is one ``enough`` accepted."""
    lo, hi = 0, max(1, start)
    while not enough(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > max(1, hi * per_mille // 1000):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def pool_bytes_for(spec: StateSpec, size: int, max_seqs: int, num_tokens: int) -> int:
    """The smallest budget (within 0.1%) whose :func:`plan_pool` has ``max_seqs`` slots and admits
    ``max_seqs`` sequences of ``num_tokens`` tokens each."""
    want = max_seqs * spec.state_bytes(num_tokens, size)

    def enough(capacity: int) -> bool:
        plan = _try_plan(spec, size, max_seqs, capacity)
        return plan is not None and plan.slots - 1 >= max_seqs and plan.admissible >= want

    return _smallest(enough, 2 * want, 1)


def min_pool_bytes(spec: StateSpec, size: int, max_seqs: int = 1 << 31) -> int:
    """The smallest budget (to the byte, where the plan is monotone in the budget) that holds one sequence of
    2 tokens, the shortest ``max_model_len``, with at most ``max_seqs`` slots: the least ``state_cache_bytes``
    an engine of that ``max_num_seqs`` accepts.  The default bounds every ``max_seqs`` (more slots only lower
    what one sequence may take); it is not the least for one slot where a second slot's pages outweigh it."""
    want = spec.state_bytes(2, size)

    def enough(capacity: int) -> bool:
        plan = _try_plan(spec, size, max_seqs, capacity)
        return plan is not None and plan.admissible >= want

    return _smallest(enough, want, 0)


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
