"""``@override``: a kernel module declares, on its wrapper, which core op it replaces and everything the backend
needs to know about it, so that adding a kernel is one new module under ``deepinfer_cuda/kernels/``.

    @override("rope", coverage=rope_covers, aot=(KERNEL,))
    def rope(x, positions, inv_freq, attention_scaling=1.0, inverse=False): ...

- ``coverage``: a predicate taking the op's arguments, True for the inputs the kernel handles (the op table runs
  core's reference for the rest: :meth:`deepinfer.backends.Backend.op_coverage`); None: every input.
- ``batch_invariant``: ``True`` when a row's result never depends on the batch (each program reads only its own
  rows, with fixed tiles); a function with the op's signature when the kernel has a fixed-tile form that is, which
  ``DEEPINFER_BATCH_INVARIANT=1`` runs instead; ``False`` (the default) when neither is declared, so core's
  batch-invariant reference runs under the flag.
- ``aot``: the kernels the wrapper launches, Triton's and TileLang's; the kernel-set builder compiles each one's
  ``aot_variants`` (TileLang's only where TileLang and nvcc are installed: an optional step).

Registering only records: :mod:`deepinfer_cuda.ops` imports the kernel modules (once the backend is chosen) and
reads the records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from deepinfer_cuda.kernel_set.dispatch import TritonKernel
from deepinfer_cuda.kernel_set.tilelang_kernel import TileLangKernel

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(slots=True, frozen=True)
class Override:
    """One kernel standing in for a core op."""

    op: str  #: the core op's name
    kernel: Callable[..., Any]  #: the wrapper: the reference's exact signature
    coverage: Callable[..., bool] | None  #: the inputs the kernel handles; None: all
    #: what runs under ``DEEPINFER_BATCH_INVARIANT=1`` (the kernel itself or its fixed-tile form); None: not declared
    batch_invariant: Callable[..., Any] | None
    aot: tuple[TritonKernel | TileLangKernel, ...]  #: the kernels it launches, compiled into the kernel set


_REGISTERED: dict[str, Override] = {}


def override(op: str, *, coverage: Callable[..., bool] | None = None,
             batch_invariant: bool | Callable[..., Any] = False,
             aot: tuple[TritonKernel | TileLangKernel, ...] = ()) -> Callable[[F], F]:
    """Register the decorated wrapper as this backend's kernel for core op ``op`` (see the module docstring)."""

    def register(fn: F) -> F:
        previous = _REGISTERED.get(op)
        if previous is not None and previous.kernel is not fn:
            raise ValueError(f"op {op!r} has two kernels: {_where(previous.kernel)} and {_where(fn)}")
        invariant = (fn if batch_invariant else None) if isinstance(batch_invariant, bool) else batch_invariant
        _REGISTERED[op] = Override(op, fn, coverage, invariant, tuple(aot))
        return fn

    return register


def registered() -> dict[str, Override]:
    """The overrides registered by the kernel modules imported so far, by op name."""
    return dict(_REGISTERED)


def _where(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"
