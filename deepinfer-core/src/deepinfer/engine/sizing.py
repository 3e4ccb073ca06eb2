"""How long a sequence may be, from the model, its state budget and the engine args (the budget itself is the state
cache's: ``engine/state_cache.py``)."""

from __future__ import annotations

import logging
from typing import Any

from deepinfer.models.base import CausalLM

logger = logging.getLogger(__name__)

#: The length limit of a model whose config names no ``max_position_embeddings``.
_UNBOUNDED = 1 << 20


def model_max_len(config: Any) -> int:
    """``max_position_embeddings`` of a model config (the checkpoint's, read before the weights load, or a built
    model's ``config``), else 2**20."""
    return getattr(config, "max_position_embeddings", None) or _UNBOUNDED


def check_max_model_len(requested: int | None, model_max: int) -> None:
    """``requested`` (already checked to be None or an integer >= 2) must not exceed the model's limit."""
    if requested is not None and requested > model_max:
        raise ValueError(f"max_model_len must be an integer in [2, {model_max}] for this model (its "
                         f"max_position_embeddings), got {requested}")


def fit_max_model_len(requested: int | None, model: CausalLM, budget: int, max_num_seqs: int) -> int:
    """``requested`` if one sequence of it fits the ``budget`` bytes the state cache admits (configured for
    ``max_num_seqs`` slots); else the largest length that does."""
    model_max = model_max_len(getattr(model, "config", None))
    check_max_model_len(requested, model_max)
    if requested is not None:
        if model.state_bytes(requested) > budget:
            enough = model.state_pool_bytes(max_num_seqs, requested, sequences=1)
            raise ValueError(f"max_model_len={requested} needs {model.state_bytes(requested)} bytes of state for one "
                             f"sequence; the state cache admits {budget} bytes: lower max_model_len or raise "
                             f"state_cache_bytes to at least {enough} (with max_num_seqs={max_num_seqs})")
        return requested
    if model.state_bytes(model_max) <= budget:
        return model_max
    lo, hi = 1, model_max  # state_bytes(lo) fits, state_bytes(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if model.state_bytes(mid) <= budget else (lo, mid)
    if lo < 2:
        raise ValueError(f"the state cache budget ({budget} bytes) cannot hold even a 2-token sequence")
    logger.info("max_model_len set to %d (the most one sequence's state fits in %d bytes; the model allows %d)",
                lo, budget, model_max)
    return lo
