"""The backend's kernels by core op: every module of :mod:`deepinfer_cuda.kernels` imported, and what their
``@override`` declarations (:mod:`deepinfer_cuda.override`) registered.  Imported only once the backend is chosen
(the kernel modules import Triton).

Each kernel takes exactly the reference op's arguments (see deepinfer/ops/; the op table checks names, kinds and
defaults when it is built) and returns the same shapes and dtypes; ``tests/backend_cuda`` runs core's conformance
suite on every one.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any, TypeVar

from deepinfer_cuda import kernels
from deepinfer_cuda.kernel_set.dispatch import TritonKernel
from deepinfer_cuda.kernel_set.tilelang_kernel import TileLangKernel
from deepinfer_cuda.override import Override, registered


@functools.cache
def overrides() -> dict[str, Override]:
    """Every override, by op name: the kernel modules are found by walking the package, so a new kernel is one new
    module."""
    for info in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"{kernels.__name__}.{info.name}")
    return registered()


def kernels_by_op(batch_invariant: bool = False) -> dict[str, Callable[..., Any]]:
    """``{op: kernel}`` as ``load_ops`` hands them to the op table; ``batch_invariant``: each op's declared
    batch-invariant form where it has one (the table drops the other kernels of batched ops under the flag)."""
    return {name: (o.batch_invariant or o.kernel) if batch_invariant else o.kernel
            for name, o in overrides().items()}


def coverage() -> dict[str, Callable[..., bool]]:
    """The coverage predicates of the kernels that handle only some inputs."""
    return {name: o.coverage for name, o in overrides().items() if o.coverage is not None}


def batch_invariant_ops() -> tuple[str, ...]:
    """The ops whose kernel (or its fixed-tile form) keeps a row's result independent of the batch."""
    return tuple(sorted(name for name, o in overrides().items() if o.batch_invariant is not None))


K = TypeVar("K", TritonKernel, TileLangKernel)


def _declared(kind: type[K]) -> tuple[K, ...]:
    """Every kernel of ``kind`` some override declares in ``aot``, once each, in op order."""
    found: dict[str, K] = {}
    for name in sorted(overrides()):
        for kernel in overrides()[name].aot:
            if isinstance(kernel, kind) and found.setdefault(kernel.name, kernel) is not kernel:
                raise ValueError(f"two {kind.__name__}s are named {kernel.name!r}")
    return tuple(found.values())


def aot_kernels() -> tuple[TritonKernel, ...]:
    """Every Triton kernel the kernel set compiles, once each, in op order."""
    return _declared(TritonKernel)


def tilelang_kernels() -> tuple[TileLangKernel, ...]:
    """Every TileLang kernel the kernel set adds where TileLang and nvcc are installed."""
    return _declared(TileLangKernel)
