"""The engine's side of speculative decoding: the policy from the environment's settings, and a step's results
applied to its sequences (``docs/spec_decode.md``).  The step itself is ``runner/speculative.py``."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from deepinfer.backends import Backend
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.request import Sequence, SequenceStatus
from deepinfer.envs import SpecDecodeEnv
from deepinfer.models.base import CausalLM, Rewindable
from deepinfer.outputs import SpecDecodingStats
from deepinfer.runner.cost_profile import profile_step_costs
from deepinfer.spec_decode.budget import SpecPolicy
from deepinfer.spec_decode.drafter import Drafter
from deepinfer.step import SpecResult

logger = logging.getLogger(__name__)


def policy_from_env(drafter: Drafter, model: CausalLM, backend: Backend, config: EngineConfig,
                    env: SpecDecodeEnv) -> SpecPolicy | None:
    """``DEEPINFER_USE_NEXTN_DECODE`` drafts a step (0: off) within the drafter's ``max_draft_len`` (an explicit
    value above it is an error), ``DEEPINFER_ENABLE_MTP_VARLEN`` with the step costs measured now; ``env``: the
    two as the engine read them."""
    k = env.draft_len
    if env.draft_len_set and k > drafter.max_draft_len:
        raise ValueError(f"DEEPINFER_USE_NEXTN_DECODE={k}: this checkpoint's drafter drafts at most "
                         f"{drafter.max_draft_len} tokens a step; set 1..{drafter.max_draft_len}, or 0 for off")
    k = min(k, drafter.max_draft_len)
    if not k:
        return None
    if not env.varlen or not isinstance(model, Rewindable):
        return SpecPolicy(k)
    limit = max(k + 1, min(config.max_num_batched_tokens, config.max_num_seqs * (k + 1)))
    table = profile_step_costs(model, backend, k + 1, limit, config.max_num_seqs)
    logger.info("verify step costs (ms) by step tokens: %s",
                ", ".join(f"{n}: {c * 1e3:.2f}" for n, c in zip(table.buckets, table.costs, strict=True)))
    return SpecPolicy(k, True, table)


def apply_results(results: list[SpecResult], seqs: Mapping[int, Sequence]) -> None:
    """Count each sequence's drafts and acceptances, and set what its state holds now (below the scheduler's
    guess when a draft was rejected) and its confidence snapshot for the next step's budget."""
    for result in results:
        seq = seqs.get(result.seq_id)
        if seq is None:
            continue
        if seq.request.spec_stats is None:
            seq.request.spec_stats = SpecDecodingStats()
        seq.request.spec_stats.record(result.num_drafts, result.num_accepted)
        if seq.status is not SequenceStatus.FINISHED:
            seq.num_computed = result.num_computed
            seq.draft_confidence = result.confidence
