"""The memory plan: before any weight is read, what each rank will hold, and whether it fits.

From config.json and the shard headers (:mod:`.plan_inputs`), for the requested parallel sizes and engine
arguments, per rank: the weights by role (:mod:`.weight_roles`) on the device and in host memory, the state
pool, the DSpark drafter's context and the workspace.  Weights are counted as the loader holds them (the tests
compare the two role by role): stored formats stay stored (expert parallelism and the drafter included), no
second copy in ``dequantize`` mode; Engram tables in host memory by default (``engram="device"`` as an option),
row-sharded over the expert-parallel group.

Sizing follows the engine (``engine/sizing.py``): the state pool is what ``max_num_seqs`` sequences of
``min(max_model_len, 8192)`` tokens need, at most ``gpu_memory_utilization`` of the memory the weights leave;
the rest must hold the workspace.  The workspace is an estimate (one layer's activations for
``max_num_batched_tokens`` rows, the sampler's logits, :data:`RUNTIME_RESERVE` for the runtime), not a measured
peak.  A plan that cannot fit raises :class:`MemoryPlanError` naming what does not fit and a configuration
that would (:func:`deepinfer.engine.plan_fit.check_fits`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.engine import weight_roles as wr
from deepinfer.engine.plan_inputs import PlanInputs
from deepinfer.kv.sizing import min_pool_bytes, pool_bytes_for
from deepinfer.models.deepseek_v41 import memory as v41
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.parallel.plan import ParallelConfig, plan_parallel

GiB = 1 << 30
#: The runtime's own device memory: its context, the allocator's slack, captured graphs, communicators.
RUNTIME_RESERVE = 1 * GiB
#: Tokens per sequence the default state pool is sized for (``engine/sizing.py``).
DEFAULT_STATE_TOKENS = 8192


class MemoryPlanError(ValueError):
    """The requested configuration cannot fit; the message says what does not and what would."""


@dataclass(slots=True, frozen=True, kw_only=True)
class PlanRequest:
    """What the plan is for: the parallel sizes, the engine arguments that size memory, and the device."""

    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    num_redundant_experts: int | None = None
    #: Where the Engram tables live: ``host`` (pinned host memory) or ``device``.
    engram: str = "host"
    #: Engram tables row-sharded over the expert-parallel group; None: when ``expert_parallel_size > 1``.
    engram_sharded: bool | None = None
    #: ``native`` (quantized weights as stored) or ``dequantize`` (``DEEPINFER_QUANTIZED_WEIGHTS``).
    quantized_weights: str = "native"
    quantized_kv: bool = False
    #: The DSpark drafter drafts (it is held only then).
    speculative: bool = False
    dtype: torch.dtype = torch.bfloat16
    #: Bytes of one GPU's memory; None: the fit is not checked.
    gpu_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    state_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.engram not in ("host", "device"):
            raise ValueError(f"engram must be 'host' or 'device', got {self.engram!r}")
        if self.quantized_weights not in ("native", "dequantize"):
            raise ValueError(f"quantized_weights must be 'native' or 'dequantize', got {self.quantized_weights!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu_memory is not None and self.gpu_memory <= 0:
            raise ValueError(f"gpu_memory must be a positive number of bytes, got {self.gpu_memory}")

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.data_parallel_size, self.expert_parallel_size, self.context_parallel_size,
                              self.num_redundant_experts)

    @property
    def shards_engram(self) -> bool:
        return self.expert_parallel_size > 1 if self.engram_sharded is None else self.engram_sharded

    def describe(self) -> str:
        """The configuration in ``LLM`` / ``deepinfer plan`` terms."""
        parts = [f"data_parallel_size={self.data_parallel_size}", f"expert_parallel_size={self.expert_parallel_size}"]
        if self.context_parallel_size > 1:
            parts.append(f"context_parallel_size={self.context_parallel_size}")
        parts.append(f"Engram tables in {'host memory' if self.engram == 'host' else 'device memory'} "
                     f"(--engram {self.engram})")
        parts.append(f"weights {self.quantized_weights} (DEEPINFER_QUANTIZED_WEIGHTS={self.quantized_weights})")
        return ", ".join(parts)


@dataclass(slots=True, frozen=True)
class RoleBytes:
    """One role's weights: in the checkpoint, and what the plan's rank holds (its scales included)."""

    role: str
    tensors: int
    stored: int
    device: int
    host: int
    scales: int  # of device + host: block scales


@dataclass(slots=True, frozen=True)
class MemoryPlan:
    """Per rank (the expert-parallel rank holding the most): weights by role, state, workspace, and the fit."""

    request: PlanRequest
    source: str
    world_size: int
    rank: int  # the EP rank shown (the one with the most device bytes)
    roles: tuple[RoleBytes, ...]
    state: int  # the state pool
    state_wanted: int  # what max_num_seqs sequences of min(max_model_len, 8192) tokens need
    state_min: int  # the least the engine accepts
    drafter_context: int
    workspace: int

    @property
    def weights_device(self) -> int:
        return sum(r.device for r in self.roles)

    @property
    def weights_host(self) -> int:
        return sum(r.host for r in self.roles)

    @property
    def device_total(self) -> int:
        return self.weights_device + self.state + self.drafter_context + self.workspace

    def role(self, name: str) -> RoleBytes:
        return next(r for r in self.roles if r.role == name)

    def problem(self, workspace: bool = True) -> str | None:
        """Why this plan does not fit one device (None: it fits, or the device's memory is unknown).
        ``workspace=False``: only what certainly does not fit (the weights, the drafter's context, the smallest
        state pool), not the workspace estimate."""
        memory = self.request.gpu_memory
        if memory is None:
            return None
        if self.weights_device > memory:
            big = sorted(self.roles, key=lambda r: -r.device)[:3]
            largest = "; ".join(f"{r.role} {human(r.device)}" for r in big if r.device)
            return (f"each rank holds {human(self.weights_device)} of weights on its device ({largest}), more than the "
                    f"device's {human(memory)}")
        estimate = self.workspace if workspace else 0
        rest = [f"the workspace (~{human(self.workspace)})"] if workspace else []
        rest += [f"the drafter's context ({human(self.drafter_context)})"] if self.drafter_context else []
        rest.append(f"the smallest state pool ({human(self.state_min)})")
        fixed = self.weights_device + self.drafter_context + estimate
        if fixed + self.state_min > memory or (self.request.state_cache_bytes is None and self.state < self.state_min):
            return (f"after {human(self.weights_device)} of weights, {human(memory - self.weights_device)} of the "
                    f"device's {human(memory)} remain; {_listing(rest)} need more")
        if workspace and self.device_total > memory:
            most = (memory - fixed) / (memory - self.weights_device)
            return (f"gpu_memory_utilization={self.request.gpu_memory_utilization} gives the state pool "
                    f"{human(self.state)}, which leaves less than the workspace's ~{human(self.workspace)}: lower it "
                    f"to {math.floor(most * 100) / 100} or less")
        return None


def _listing(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def human(n: int) -> str:
    """Bytes in GiB (MiB below one GiB)."""
    return f"{n / GiB:,.1f} GiB" if abs(n) >= GiB else f"{n / (1 << 20):,.1f} MiB"


class MemoryPlanner:
    """Plans of one checkpoint for any request (the tensors' held bytes are summed once per weight mode)."""

    def __init__(self, inputs: PlanInputs):
        self.inputs = inputs
        self._weights: dict[tuple[bool, int], dict[str, tuple[wr.RoleWeights, wr.RoleWeights]]] = {}

    def weights(self, native: bool, element_size: int) -> dict[str, tuple[wr.RoleWeights, wr.RoleWeights]]:
        """Per role: (its tensors, its scales) summed as held."""
        key = (native, element_size)
        if key not in self._weights:
            holding = wr.Holding(native, element_size, v41.held_in_fp32(self.inputs.config))
            held = wr.held_tensors(self.inputs.tensors, holding)
            by_role = {role: [t for t in held if t.role == role] for role in wr.ROLES}
            self._weights[key] = {role: (wr.RoleWeights.of(ts), wr.RoleWeights.of([t for t in ts if t.scale]))
                                  for role, ts in by_role.items()}
        return self._weights[key]

    def ranks(self, request: PlanRequest) -> list[tuple[RoleBytes, ...]]:
        """Each expert-parallel rank's weights by role (ranks of other EP groups hold the same).  Raises
        ``ValueError`` for parallel sizes the planner refuses (``parallel/plan.py``)."""
        cfg, parallel = self.inputs.config, request.parallel
        layout = plan_parallel(parallel, parallel.world_size, 0, n_routed_experts=cfg.n_routed_experts,
                               num_moe_layers=cfg.num_hidden_layers)
        weights = self.weights(request.quantized_weights == "native", _element_size(request))
        return [_rank_roles(weights, request, layout.placement, cfg.n_routed_experts, r)
                for r in range(layout.ep_size)]

    def plan(self, request: PlanRequest) -> MemoryPlan:
        """The plan of ``request``, shown for the rank holding the most."""
        ranks = self.ranks(request)
        rank = max(range(len(ranks)), key=lambda r: sum(b.device for b in ranks[r]))
        inputs, size = self.inputs, _element_size(request)
        wanted, least = _state_sizes(inputs, request, size)
        return MemoryPlan(request, inputs.source, request.parallel.world_size, rank, ranks[rank],
                          _state(request, ranks[rank], wanted), wanted, least, _drafter_context(inputs, request, size),
                          _workspace(inputs, request, size))


def _element_size(request: PlanRequest) -> int:
    return torch.empty(0, dtype=request.dtype).element_size()


def _rank_roles(weights: dict[str, tuple[wr.RoleWeights, wr.RoleWeights]], request: PlanRequest,
                placement: ExpertPlacement | None, n_experts: int, ep_rank: int) -> tuple[RoleBytes, ...]:
    """Rank ``ep_rank``'s bytes of every role (the same for ranks of other EP groups)."""
    shards = request.expert_parallel_size if request.shards_engram else 1

    def local(layer: int) -> Sequence[int]:
        return range(n_experts) if placement is None else placement.local_experts(layer, ep_rank)

    def place(role: str, w: wr.RoleWeights) -> wr.Split:
        if role == wr.ROUTED:
            return wr.routed_experts(w, local)
        if role == wr.ENGRAM_TABLES:
            return wr.engram_tables(w, shards, ep_rank % shards, request.engram == "host")
        if role == wr.DRAFTER:
            return wr.drafter(w, request.speculative)
        return wr.whole(w)

    out = []
    for role, (tensors, scales) in weights.items():
        device, host = place(role, tensors)
        out.append(RoleBytes(role, tensors.tensors, tensors.stored, device, host, sum(place(role, scales))))
    return tuple(out)


def _state_sizes(inputs: PlanInputs, request: PlanRequest, size: int) -> tuple[int, int]:
    """(the default state pool's size, the least the engine accepts: one sequence of ``max_model_len`` tokens,
    or of 2 without one)."""
    cfg = inputs.config
    spec = v41.sequence_state(cfg, request.quantized_kv)
    tokens = min(request.max_model_len or cfg.max_position_embeddings, DEFAULT_STATE_TOKENS)
    wanted = pool_bytes_for(spec, size, request.max_num_seqs, tokens)
    if request.max_model_len is None:
        return wanted, min_pool_bytes(spec, size, request.max_num_seqs)
    return wanted, pool_bytes_for(spec, size, request.max_num_seqs, request.max_model_len, sequences=1,
                                  per_mille=0)


def _state(request: PlanRequest, roles: tuple[RoleBytes, ...], wanted: int) -> int:
    if request.state_cache_bytes is not None:
        return request.state_cache_bytes
    if request.gpu_memory is None:
        return wanted
    free = request.gpu_memory - sum(r.device for r in roles)
    return max(0, min(wanted, int(request.gpu_memory_utilization * free)))


def _drafter_context(inputs: PlanInputs, request: PlanRequest, size: int) -> int:
    if not request.speculative:
        return 0
    return v41.drafter_context_bytes(inputs.config, request.max_num_seqs + 1, size)


def _workspace(inputs: PlanInputs, request: PlanRequest, size: int) -> int:
    cfg = inputs.config
    logits = 2 * request.max_num_seqs * cfg.vocab_size * 4  # the sampled rows' fp32 logits and probabilities
    return v41.activation_bytes(cfg, request.max_num_batched_tokens, size) + logits + RUNTIME_RESERVE
