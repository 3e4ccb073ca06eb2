"""Every ``DEEPINFER_*`` environment variable, read and validated in one place.

Values are read when asked for (not at import), so a process may set them before building an LLM; an engine
reads each once (``LLM`` reads the speculative-decoding pair with :func:`spec_decode` and hands it down).
Invalid values raise ``ValueError`` naming the variable and what it accepts.  :func:`validate` (called when
an ``LLM`` starts) reads every variable, so a bad value fails at start-up even when its feature is not used
in this run, and warns about ``DEEPINFER_*`` names it does not know (a typo, or a variable of another
version: a warning, not an error, because an environment outlives the version that set it up).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PREFIX = "DEEPINFER_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@contextlib.contextmanager
def overridden(name: str, value: str) -> Iterator[None]:
    """``name`` set to ``value`` inside the block; after it, as it was before (set to its old value, or unset)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def is_set(name: str) -> bool:
    """Whether ``name`` is set to something other than blanks."""
    return bool(os.environ.get(name, "").strip())


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


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name, "")
    value = raw.strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {choices}")
    return value


def accelerator() -> str | None:
    """``DEEPINFER_ACCELERATOR``: backend name (``nvidia``, ``ascend``, ``cpu`` or a third party's).

    Unset or empty: the highest-priority usable installed backend is chosen and logged.  Whether the name is
    installed and usable is checked when the backend is selected (the error lists what is installed).
    """
    raw = os.environ.get("DEEPINFER_ACCELERATOR", "").strip()
    return raw or None


def hf_model_dir() -> str | None:
    """``DEEPINFER_HF_MODEL_DIR``: local checkpoint directory used instead of downloading weights.

    What the directory holds is checked where it is used (``engine.model_source``); :func:`validate` checks
    that it exists even when ``LLM(model=...)`` names another checkpoint.
    """
    raw = os.environ.get("DEEPINFER_HF_MODEL_DIR", "").strip()
    return raw or None


def _check_hf_model_dir() -> None:
    raw = hf_model_dir()
    if raw is not None and not os.path.isdir(os.path.expanduser(raw)):
        raise ValueError(f"DEEPINFER_HF_MODEL_DIR={raw!r}: not an existing directory (a checkpoint directory with "
                         "config.json, *.safetensors and the tokenizer files); unset it or fix the path")


def enable_mtp_varlen() -> bool:
    """``DEEPINFER_ENABLE_MTP_VARLEN``: DSpark drafting with confidence-scheduled verification."""
    return _flag("DEEPINFER_ENABLE_MTP_VARLEN", False)


def nextn_decode() -> int:
    """``DEEPINFER_USE_NEXTN_DECODE``: maximum draft length per step (0..16, default 5); 0 turns drafting off."""
    return _int("DEEPINFER_USE_NEXTN_DECODE", 5, 0, 16)


@dataclass(slots=True, frozen=True)
class SpecDecodeEnv:
    """The two variables of speculative decoding, read together: the draft length and whether it was given (an
    explicit value above the drafter's block is refused; unset, it is capped and a capturing backend leaves
    speculation off), and confidence-scheduled verification and whether it was given."""

    draft_len: int  # DEEPINFER_USE_NEXTN_DECODE (0: off)
    draft_len_set: bool
    varlen: bool  # DEEPINFER_ENABLE_MTP_VARLEN
    varlen_set: bool


def spec_decode() -> SpecDecodeEnv:
    """``DEEPINFER_USE_NEXTN_DECODE`` and ``DEEPINFER_ENABLE_MTP_VARLEN`` as one value to hand down."""
    return SpecDecodeEnv(nextn_decode(), is_set("DEEPINFER_USE_NEXTN_DECODE"), enable_mtp_varlen(),
                         is_set("DEEPINFER_ENABLE_MTP_VARLEN"))


def batch_invariant() -> bool:
    """``DEEPINFER_BATCH_INVARIANT``: a request's logits are bitwise independent of the rest of the batch.

    Read when an op table is built (it selects the batch-invariant op forms); together with
    ``SamplingParams(seq_seed=...)`` it makes sampling deterministic.  See docs/reproducibility.md.
    """
    return _flag("DEEPINFER_BATCH_INVARIANT", False)


YOCO_TRUNCATION_MODES = ("none", "compact")


def yoco_prefill_truncation_mode() -> str:
    """``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE``: ``none`` (default) or ``compact`` (V4.1 decoder truncation)."""
    return _choice("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "none", YOCO_TRUNCATION_MODES)


def yoco_prefill_keep_tokens() -> int:
    """``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``: prompt suffix the V4.1 decoder runs on (default 140).

    The lower bound against the SWA window and drafter lookback is checked where the model is known.
    """
    return _int("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", 140, 1, 1 << 30)


QUANTIZED_WEIGHTS_MODES = ("dequantize", "native")


def quantized_weights() -> str | None:
    """``DEEPINFER_QUANTIZED_WEIGHTS``: what a quantized checkpoint's weights become at load.

    ``native``: FP8 block-scaled dense weights and MXFP4 / FP8 routed experts stay in their stored form in device
    memory and run through the op table's quantized GEMMs (``fp8_block_linear``, ``moe_experts_mxfp4``,
    ``moe_experts_fp8``; docs/models/deepseek_v41.md, "Formats").  ``dequantize``: the compute dtype.  Unset
    (None): ``native`` where the backend has kernels for those ops, else ``dequantize``
    (:func:`deepinfer.models.weights_mode.weights_mode`).
    """
    if not is_set("DEEPINFER_QUANTIZED_WEIGHTS"):
        return None
    return _choice("DEEPINFER_QUANTIZED_WEIGHTS", "dequantize", QUANTIZED_WEIGHTS_MODES)


def quantized_kv() -> bool:
    """``DEEPINFER_QUANTIZED_KV``: V4.1's state stores K=V and indexer keys in the model's own formats (SWA FP8,
    compressed latents and indexer keys FP4, with their scales), dequantized where read.  The logits are
    unchanged (the model fake-quantizes there); the state takes ~3.4x fewer bytes per token than bf16."""
    return _flag("DEEPINFER_QUANTIZED_KV", False)


MXFP4_ACTIVATION_DTYPES = ("bf16", "fp8")


def mxfp4_activations() -> str:
    """``DEEPINFER_MXFP4_ACTIVATIONS``: what MXFP4 routed experts multiply their weights with.  ``bf16`` (default):
    the activations as they are, exact to the reference.  ``fp8``: rounded to e4m3 with a scale a row (W4A8), where
    the backend has such kernels (CUDA SM90: docs/cuda_backend.md); faster, with a measured error
    (docs/performance.md); a backend without them runs ``bf16``."""
    return _choice("DEEPINFER_MXFP4_ACTIVATIONS", "bf16", MXFP4_ACTIVATION_DTYPES)


LOGGING_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
                  "critical": logging.CRITICAL}


def logging_level() -> int:
    """``DEEPINFER_LOGGING_LEVEL``: level of the ``deepinfer`` logger (default ``INFO``; any case)."""
    return LOGGING_LEVELS[_choice("DEEPINFER_LOGGING_LEVEL", "info", tuple(LOGGING_LEVELS))]


def api_key() -> str | None:
    """``DEEPINFER_API_KEY``: the key ``deepinfer serve`` requires on ``/v1/*`` (``--api-key`` takes precedence);
    unset or blank: no key.  Surrounding blanks are dropped (a key pasted with a newline still matches)."""
    return os.environ.get("DEEPINFER_API_KEY", "").strip() or None


def venv() -> str | None:
    """``DEEPINFER_VENV``: the virtual environment ``build.sh`` creates or reuses (read by build.sh only)."""
    return os.environ.get("DEEPINFER_VENV", "").strip() or None


#: Every variable DeepInfer reads, and what :func:`validate` calls to check it (its reader, mostly).
VARIABLES: dict[str, Callable[[], object]] = {
    "DEEPINFER_ACCELERATOR": accelerator,
    "DEEPINFER_HF_MODEL_DIR": _check_hf_model_dir,
    "DEEPINFER_ENABLE_MTP_VARLEN": enable_mtp_varlen,
    "DEEPINFER_USE_NEXTN_DECODE": nextn_decode,
    "DEEPINFER_BATCH_INVARIANT": batch_invariant,
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": yoco_prefill_truncation_mode,
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": yoco_prefill_keep_tokens,
    "DEEPINFER_QUANTIZED_WEIGHTS": quantized_weights,
    "DEEPINFER_QUANTIZED_KV": quantized_kv,
    "DEEPINFER_MXFP4_ACTIVATIONS": mxfp4_activations,
    "DEEPINFER_LOGGING_LEVEL": logging_level,
    "DEEPINFER_API_KEY": api_key,
    "DEEPINFER_VENV": venv,
}


def check_consistency(values: dict[str, object] | None = None) -> None:
    """Reject combinations that cannot hold together; called at engine start-up.  ``values``: the variables
    already read (:func:`validate`'s), else they are read here."""
    invariant = values["DEEPINFER_BATCH_INVARIANT"] if values is not None else batch_invariant()
    varlen = values["DEEPINFER_ENABLE_MTP_VARLEN"] if values is not None else enable_mtp_varlen()
    if invariant and varlen:
        raise ValueError(
            "DEEPINFER_BATCH_INVARIANT=1 with DEEPINFER_ENABLE_MTP_VARLEN=1: confidence-scheduled verification "
            "admits drafts by a batch-wide budget, so a request's tokens depend on its neighbours; set "
            "DEEPINFER_ENABLE_MTP_VARLEN=0 for batch-invariant (deterministic) runs"
        )


def unknown_variables() -> dict[str, str | None]:
    """Set ``DEEPINFER_*`` names DeepInfer does not read, each with the known name it most resembles (or None)."""
    return {
        name: next(iter(difflib.get_close_matches(name, VARIABLES, n=1, cutoff=0.8)), None)
        for name in sorted(os.environ) if name.startswith(PREFIX) and name not in VARIABLES
    }


def validate() -> None:
    """Read every variable once (raising on the first invalid one), check combinations, warn about unknown names."""
    check_consistency({name: check() for name, check in VARIABLES.items()})
    for name, close in unknown_variables().items():
        hint = f"did you mean {close}? " if close else ""
        logger.warning("%s is set but DeepInfer reads no such variable (%sknown: README's Configuration table); "
                       "it has no effect", name, hint)
