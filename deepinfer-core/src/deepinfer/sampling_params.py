"""How to sample one request: vLLM's ``SamplingParams`` fields, validated up front."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

#: Most top-k alternatives a request may ask for per position (``logprobs`` / ``prompt_logprobs``).
MAX_LOGPROBS = 20

#: ``temperature`` below this samples greedily (dividing logits by it would overflow them).
GREEDY_TEMPERATURE = 1e-5

_SEED_LOW, _SEED_HIGH = -(2**63), 2**64


class RequestOutputKind(enum.Enum):
    """What a streaming consumer receives per step (vLLM's): ``CUMULATIVE`` everything so far, ``DELTA`` only
    what is new since the last output, ``FINAL_ONLY`` one output when the request finishes.  ``LLM.generate``
    returns whole outputs whatever the kind; ``LLM.generate_stream`` and the server follow it."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(slots=True)
class SamplingParams:
    """Sampling settings of one request (see ``docs/engine.md``).

    ``temperature=0`` is greedy.  ``logprobs=k`` returns, per generated token, the ``k`` most likely
    tokens plus the sampled one, with log-probabilities of the raw model distribution (before
    penalties, temperature and truncation).  ``seq_seed`` (alias ``seed``) makes sampling
    reproducible independently of the batch; unseeded requests get a seed from ``LLM(seed=...)``.
    Invalid values raise ``ValueError`` naming the field and its allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seq_seed: int | None = None
    seed: int | None = None
    so_args: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: vLLM's form of ``so_args`` (``deepinfer.structured.vllm_names.StructuredOutputsParams``).
    structured_outputs: Any = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; normalise ``stop`` and the ``seed`` alias.  Raises ``ValueError``."""
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 to disable, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}"
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(
                f"max_tokens must be an integer >= 1 or None (up to max_model_len), got {self.max_tokens!r}"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        self.stop_strings = self._check_stop(self.stop)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids
            ):
                raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                             f"got {self.output_kind!r}")
        self._check_seed()
        self._check_so_args()

    @staticmethod
    def _check_stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        strings = [stop] if isinstance(stop, str) else stop
        if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
        return tuple(strings)

    def _check_seed(self) -> None:
        for name in ("seq_seed", "seed"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not _SEED_LOW <= value < _SEED_HIGH):
                raise ValueError(f"{name} must be None or an integer in [-2**63, 2**64), got {value!r}")
        if self.seq_seed is not None and self.seed is not None and self.seq_seed != self.seed:
            raise ValueError(
                f"seed is an alias of seq_seed; got both with different values ({self.seed}, {self.seq_seed})"
            )
        self.seq_seed = self.seed = self.seq_seed if self.seq_seed is not None else self.seed

    def _check_so_args(self) -> None:
        """Shape only (one known key, right value type); the grammar itself is compiled per request."""
        if self.structured_outputs is not None:
            from deepinfer.structured.vllm_names import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            so_args = self.structured_outputs.to_so_args()
            if self.so_args is not None and self.so_args != so_args:
                raise ValueError("structured_outputs and so_args are two forms of one setting; give one")
            self.so_args = so_args
        if self.so_args is not None:
            from deepinfer.structured.spec import parse_so_args

            parse_so_args(self.so_args)

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p removes tokens (else sampling only scales by the temperature)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
