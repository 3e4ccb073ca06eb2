"""``EngineArgs``: every knob of ``LLM(...)``, each written once with its default, meaning and check.

``LLM(model, **kwargs)`` and ``LLM.from_model(model, tokenizer, **kwargs)`` build one from their keywords
(:meth:`EngineArgs.from_kwargs`).  Names are vLLM's where the concept is the same.  The checks here need only the
values; ``max_model_len`` against the checkpoint's ``max_position_embeddings`` is checked from config.json
before the weights load (``deepinfer.engine.sizing``), and the state budget once the model is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from deepinfer.engine import checks
from deepinfer.engine.unsupported import NOT_BUILT, refusal
from deepinfer.sampling_params import MAX_LOGPROBS

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16}
_DTYPE_HELP = f"'auto', one of {sorted(_DTYPES)} or one of torch.float32, torch.bfloat16, torch.float16"


def _dtype(name: str, value: Any) -> Any:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"{name} must be {_DTYPE_HELP}, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be {_DTYPE_HELP}, got {type(value).__name__} {value!r}")
    if value != "auto" and value not in _DTYPES:
        raise ValueError(f"{name} must be {_DTYPE_HELP}, got {value!r}")
    return value


def _knob(default: Any, check: checks.Check) -> Any:
    """A field with its default and the check ``__post_init__`` runs on it."""
    return dataclasses.field(default=default, metadata={"check": check})


@dataclasses.dataclass(slots=True, frozen=True, kw_only=True)
class EngineArgs:
    """The user's settings of one ``LLM`` (see ``docs/engine.md``, "Engine arguments")."""

    #: Local checkpoint directory, Hugging Face repo id, or None: ``DEEPINFER_HF_MODEL_DIR``, else the default
    #: checkpoint if cached, else the embedded tiny model (``deepinfer.engine.model_source``).
    model: str | os.PathLike[str] | None = _knob(None, checks.path(optional=True))
    #: Tokenizer directory; None: the checkpoint's.
    tokenizer: str | os.PathLike[str] | None = _knob(None, checks.path(optional=True))
    #: Hub revision (branch, tag or commit) of a repo id ``model``.
    revision: str | None = _knob(None, checks.text(optional=True))
    #: Compute dtype: ``"auto"`` (the checkpoint's ``dtype`` / ``torch_dtype``, bf16 if it names none), a name
    #: or a torch dtype.
    dtype: str | torch.dtype = _knob("auto", _dtype)
    #: Seeds the per-request seeds of requests without ``SamplingParams.seed``.
    seed: int = _knob(0, checks.integer())
    #: Longest prompt + output in tokens; None: the model's ``max_position_embeddings``, lowered (logged) to the
    #: longest sequence whose state fits the state cache budget.
    max_model_len: int | None = _knob(None, checks.integer(2, optional=True))
    #: Most sequences in one step (lowered, logged, to the sequence slots the state cache budget holds).
    max_num_seqs: int = _knob(256, checks.integer(1))
    #: Most tokens in one step; longer prompts are prefilled in chunks.
    max_num_batched_tokens: int = _knob(8192, checks.integer(1))
    #: Bytes of model state for all sequences, allocated once.  None: what ``max_num_seqs`` sequences of
    #: ``min(max_model_len, 8192)`` tokens need, at most ``gpu_memory_utilization`` of the free device memory.
    state_cache_bytes: int | None = _knob(None, checks.integer(1, optional=True))
    #: Fraction of the device memory free after loading the weights that the default state cache may take
    #: (vLLM's name; it applies to every backend's device).
    gpu_memory_utilization: float = _knob(0.9, checks.fraction())
    #: Most top-k alternatives per position a request may ask for (``logprobs``, ``prompt_logprobs``).
    max_logprobs: int = _knob(MAX_LOGPROBS, checks.integer(0, MAX_LOGPROBS))
    #: Run decode steps eagerly instead of replaying captured graphs (debugging).
    enforce_eager: bool = _knob(False, checks.flag())
    #: Queue each step before reading the previous one's tokens; False runs steps strictly one after the other
    #: (debugging; outputs are the same).
    async_scheduling: bool = _knob(True, checks.flag())
    #: Reuse the compressed state of prompt prefixes other requests computed (docs/prefix_caching.md; vLLM's
    #: name).  None (default): on where it is exact and tested, a single-rank engine over a model with a prefix
    #: cache (V4, V4.1); off on several ranks.
    enable_prefix_caching: bool | None = _knob(None, checks.flag(optional=True))
    #: Ranks that each own whole requests (data-parallel attention; ``docs/parallel.md``).  With
    #: ``context_parallel_size``, the world size: ``LLM`` starts that many ranks, or joins torchrun's.
    data_parallel_size: int = _knob(1, checks.integer(1))
    #: Ranks that split each MoE layer's experts between them (divides the world size).
    expert_parallel_size: int = _knob(1, checks.integer(1))
    #: Ranks that split one DP rank's long prefills (balanced zigzag).
    context_parallel_size: int = _knob(1, checks.integer(1))
    #: Extra expert slots per MoE layer for EPLB's replicas; None: the fewest that divide over the EP ranks.
    num_redundant_experts: int | None = _knob(None, checks.integer(0, optional=True))
    #: Rebalance experts (EPLB, from the load counted while serving) every this many steps; None: never.
    eplb_step_interval: int | None = _knob(None, checks.integer(1, optional=True))
    #: Seconds a collective waits for the other ranks before failing (a rank that died makes the others raise).
    distributed_timeout: int = _knob(300, checks.integer(1))
    #: Where V4.1's Engram tables live: ``"host"`` memory the device reads in place (pinned, zero-copy on CUDA;
    #: the released tables are ~189 GiB) or ``"device"`` memory (when they fit).  Outputs are the same bit for bit.
    engram_placement: str = _knob("host", checks.choice("host", "device"))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        if self.enable_prefix_caching and self.context_parallel_size > 1:
            raise ValueError(f"enable_prefix_caching=True with context_parallel_size={self.context_parallel_size}: "
                             "prefix caching is not built for context parallelism yet (its replay is untested "
                             "across ranks); use context_parallel_size=1 or leave prefix caching off")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], *, caller: str = "LLM",
                    excluded: Mapping[str, str] | None = None, also: Iterable[str] = ()) -> EngineArgs:
        """Arguments from ``caller``'s keywords.  A vLLM keyword for a feature not built here raises
        ``ValueError`` saying what to use instead (unless its value asks for nothing, e.g.
        ``tensor_parallel_size=1``); an unknown one raises ``TypeError`` naming the closest valid name.
        ``excluded``: knobs ``caller`` does not take, with the reason; ``also``: its other keywords (for hints)."""
        excluded = excluded or {}
        valid = [n for n in cls.names() if n not in excluded]
        accepted: dict[str, Any] = {}
        for name, value in kwargs.items():
            if name in excluded:
                raise TypeError(f"{caller}() does not take {name}: {excluded[name]}")
            if name in valid:
                accepted[name] = value
                continue
            if (why := refusal(name, value)) is not None:
                raise ValueError(why)
            if name not in NOT_BUILT:
                raise TypeError(_unknown(caller, name, [*valid, *also]))
        return cls(**accepted)


def _unknown(caller: str, name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{caller}() got an unexpected keyword argument {name!r}; {hint}valid: {', '.join(sorted(valid))}"


def resolve_dtype(dtype: str | torch.dtype, checkpoint: Path | None) -> torch.dtype:
    """``"auto"`` = the checkpoint's ``dtype`` / ``torch_dtype`` (bf16 if it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        return _DTYPES[_dtype("dtype", dtype)]
    config = json.loads((checkpoint / "config.json").read_text()) if checkpoint else {}
    named = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if named not in _DTYPES:
        raise ValueError(f"{checkpoint}/config.json names dtype {named!r}, which DeepInfer cannot compute in; "
                         f"pass dtype= one of {sorted(_DTYPES)}")
    return _DTYPES[named]
