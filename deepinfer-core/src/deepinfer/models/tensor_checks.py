"""Checks on checkpoint tensors that a shape check misses: the stored dtype, finite values, id ranges.

A weight stored as int32 or bool, a NaN, or an expert id past the last expert would otherwise load and
fail (or silently mislead) only inside ``generate``.  Dtypes are checked from the headers with the shapes;
values as each tensor is loaded, with one min/max pass (``aminmax``: a read of the tensor, no allocation
of its size), so the cost stays a small part of reading the data.
"""

from __future__ import annotations

import math

import torch

from deepinfer.models.checkpoint_files import CheckpointError

#: safetensors dtype names, by what a tensor of that role may be stored as.
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
INT_DTYPES = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8")
FP8_DTYPES = ("F8_E4M3",)
FP4_DTYPES = ("I8", "U8")  # two e2m1 codes per byte
FP8_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0", "U8")
MXFP4_SCALE_DTYPES = ("F8_E8M0", "U8")

#: Problems listed in one error before the rest are counted.
MAX_LISTED = 20


def dtype_problem(found: str, allowed: tuple[str, ...], role: str) -> str | None:
    """``None`` if ``found`` is one of ``allowed``; else what was expected for a tensor of ``role``."""
    if found in allowed:
        return None
    return f"expected dtype {'/'.join(allowed)} ({role}), found {found}"


def problems_error(subject: str, problems: list[str]) -> CheckpointError:
    """One line for many problems: the first :data:`MAX_LISTED` of them, then how many more."""
    listed = "; ".join(problems[:MAX_LISTED])
    more = f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return CheckpointError(f"{subject} ({len(problems)} problems): {listed}{more}")


def _min_max(tensor: torch.Tensor) -> tuple[float, float]:
    lo, hi = torch.aminmax(tensor)
    lo_value, hi_value = torch.stack([lo.double(), hi.double()]).tolist()  # one device sync
    return lo_value, hi_value


def check_finite(where: str, tensor: torch.Tensor, stored: torch.Tensor | None = None) -> None:
    """Raise if ``tensor`` (floating point) holds a NaN or an infinity.  ``stored``: the tensor as read, when
    ``tensor`` is its conversion, so the message can tell a stored NaN/inf from a value the target dtype
    cannot hold."""
    if tensor.numel() == 0:
        return
    lo, hi = _min_max(tensor)
    if math.isfinite(lo) and math.isfinite(hi):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    nan = int(torch.isnan(tensor).sum())
    cause = ""
    if stored is not None and stored.dtype != tensor.dtype and bool(torch.isfinite(stored.float()).all()):
        cause = f" after conversion from {_short(stored.dtype)} to {_short(tensor.dtype)} (values out of its range)"
    raise CheckpointError(f"{where}: expected finite values, found {bad} of {tensor.numel()} non-finite "
                          f"({nan} NaN, {bad - nan} inf){cause}")


def check_ids(where: str, tensor: torch.Tensor, count: int, field: str) -> None:
    """Raise unless every value of the integer ``tensor`` is an id in ``[0, count)`` (``count`` is config
    ``field``)."""
    if tensor.numel() == 0:
        return
    lo, hi = _min_max(tensor)
    if lo < 0 or hi >= count:
        bad = int(((tensor < 0) | (tensor >= count)).sum())
        raise CheckpointError(f"{where}: expected ids in [0, {count}) ({field} = {count}), found values from "
                              f"{int(lo)} to {int(hi)} ({bad} out of range)")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
