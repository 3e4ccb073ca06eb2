"""Every ``DEEPINFER_*`` environment variable, read and validated in one place.

Values are read when asked for (not at import), so a process may set them before building an LLM.
Invalid values raise ``ValueError`` naming the variable and what it accepts.
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _int(name: str, default: int, low: int, high: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer in [{low}, {high}]") from None
    if not low <= value <= high:
        raise ValueError(f"{name}={value}: must be in [{low}, {high}]")
    return value


def accelerator() -> str | None:
    """``DEEPINFER_ACCELERATOR``: backend name (``nvidia``, ``ascend``, ``cpu`` or a third party's).

    Unset or empty: the highest-priority usable installed backend is chosen and logged.
    """
    raw = os.environ.get("DEEPINFER_ACCELERATOR", "").strip()
    return raw or None


def hf_model_dir() -> str | None:
    """``DEEPINFER_HF_MODEL_DIR``: local checkpoint directory used instead of downloading weights."""
    raw = os.environ.get("DEEPINFER_HF_MODEL_DIR", "").strip()
    return raw or None


def enable_mtp_varlen() -> bool:
    """``DEEPINFER_ENABLE_MTP_VARLEN``: DSpark drafting with confidence-scheduled verification."""
    return _flag("DEEPINFER_ENABLE_MTP_VARLEN", False)


def nextn_decode() -> int:
    """``DEEPINFER_USE_NEXTN_DECODE``: maximum draft length per step (1..16, default 5)."""
    return _int("DEEPINFER_USE_NEXTN_DECODE", 5, 1, 16)


def batch_invariant() -> bool:
    """``DEEPINFER_BATCH_INVARIANT``: a request's logits are bitwise independent of the rest of the batch.

    Read when an op table is built (it selects the batch-invariant op forms); together with
    ``SamplingParams(seq_seed=...)`` it makes sampling deterministic.  See docs/reproducibility.md.
    """
    return _flag("DEEPINFER_BATCH_INVARIANT", False)


YOCO_TRUNCATION_MODES = ("none", "compact")


def yoco_prefill_truncation_mode() -> str:
    """``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE``: ``none`` (default) or ``compact`` (V4.1 decoder truncation)."""
    raw = os.environ.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "none").strip().lower() or "none"
    if raw not in YOCO_TRUNCATION_MODES:
        raise ValueError(f"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE={raw!r}: expected one of {YOCO_TRUNCATION_MODES}")
    return raw


def yoco_prefill_keep_tokens() -> int:
    """``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``: prompt suffix the V4.1 decoder runs on (default 140).

    The lower bound against the SWA window and drafter lookback is checked where the model is known.
    """
    return _int("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", 140, 1, 1 << 30)


def check_consistency() -> None:
    """Reject combinations that cannot hold together; called at engine start-up."""
    if batch_invariant() and enable_mtp_varlen():
        raise ValueError(
            "DEEPINFER_BATCH_INVARIANT=1 with DEEPINFER_ENABLE_MTP_VARLEN=1: confidence-scheduled verification "
            "admits drafts by a batch-wide budget, so a request's tokens depend on its neighbours; set "
            "DEEPINFER_ENABLE_MTP_VARLEN=0 for batch-invariant (deterministic) runs"
        )
