"""The roofline every benchmark and sweep compares against, measured in the same run on random data: device copy
bandwidth, bf16 matmul rate, FP8 matmul rate.

On the CPU (``device="cpu"``, ``small``: a few MB and a 512-wide matmul) they are timed with torch, so the
benchmarks' ``--tiny`` runs test them there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tools.timing import device_time, time_median


@dataclass(slots=True, frozen=True)
class Ceilings:
    """What a step's floor is computed from."""

    bandwidth: float  #: device copy bytes per second, read + written
    bf16_flops: float  #: bf16 matmul FLOP/s
    fp8_flops: float | None = None  #: FP8 e4m3 matmul FLOP/s (None: not measured)


def _seconds(fn: Callable[[], object], device: str) -> float:
    return device_time(fn) if device == "cuda" else time_median(fn, 3)


def copy_bandwidth(device: str = "cuda", small: bool = False) -> float:
    """Device-to-device copy bytes (read + written) per second, over 1 GiB (``small``: 8 MiB)."""
    import torch

    src = torch.empty(1 << (23 if small else 30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / _seconds(lambda: dst.copy_(src), device)


def matmul_rate(device: str = "cuda", small: bool = False) -> float:
    """bf16 FLOP/s of an 8192^3 matmul (``small``: 512^3)."""
    import torch

    m = 512 if small else 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    return 2 * m**3 / _seconds(lambda: a @ b, device)


def fp8_matmul_rate(device: str = "cuda", small: bool = False) -> float | None:
    """FP8 e4m3 FLOP/s (cuBLAS through ``torch._scaled_mm``, per-tensor scales, bf16 out); None where it cannot run
    (no CUDA, or a torch without it)."""
    import torch

    if device != "cuda":
        return None
    m = 512 if small else 8192
    a = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    try:
        seconds = device_time(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    except (RuntimeError, AttributeError, TypeError) as exc:
        print(f"FP8 matmul ceiling not measured: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        return None
    return 2 * m**3 / seconds


def ceilings(device: str = "cuda", small: bool = False, fp8: bool = False) -> Ceilings:
    """Copy bandwidth and bf16 matmul rate (and, with ``fp8``, the FP8 rate) of ``device``."""
    return Ceilings(copy_bandwidth(device, small), matmul_rate(device, small),
                    fp8_matmul_rate(device, small) if fp8 else None)
