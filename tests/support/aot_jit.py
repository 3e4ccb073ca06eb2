"""The GPU check that a kernel set's AOT cubins compute what Triton's JIT does, bit for bit, and that calls at the
model's shapes find a cubin (nothing JITs).  Shared by tests/backend_cuda's kernel tests (V4, quantized, V4.1);
imports the CUDA backend only when called, so their modules import on the CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

#: (the op or kernel module a case calls, its arguments)
Case = tuple[Any, tuple]


def _shapes(args: tuple) -> list[Any]:
    return [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]


def assert_aot_equals_jit(kernel_set: Path, kernels: Iterable[Any], cases: Sequence[Case],
                          call: Callable[[Any, tuple], Any], *, restore: Any, name: Callable[[Any], str] = str,
                          jit_relaunches_all: bool = False) -> None:
    """Run ``cases`` (``call(op, args)``) with ``kernel_set`` active, then with none (JIT only), and check:

    - the set loads (no refusal), no launch of ``kernels`` went through the JIT, and at least one cubin launch
      per case (a case may launch several kernels);
    - ``jit_relaunches_all``: the JIT run launched the ``kernels`` as often as the AOT run did;
    - each case's outputs (a tensor or a tuple of tensors) are bitwise equal between the two runs.

    ``restore``: the kernel set (a directory, a ``KernelSet`` or None) made active afterwards, even on failure;
    ``name(op)``: how a failing case is named."""
    from deepinfer_cuda.kernel_set.dispatch import use_kernel_set

    kernels = list(kernels)
    try:
        ks = use_kernel_set(kernel_set)
        assert ks.refusal is None, ks.refusal
        for k in kernels:
            k.reset()
        aot = [call(op, args) for op, args in cases]
        assert {k.name: k.launch_counts["jit"] for k in kernels} == {k.name: 0 for k in kernels}
        launches = sum(k.launch_counts["cubin"] for k in kernels)
        assert launches >= len(cases)
        use_kernel_set(None)
        jit = [call(op, args) for op, args in cases]
        if jit_relaunches_all:
            assert sum(k.launch_counts["jit"] for k in kernels) == launches
    finally:
        use_kernel_set(restore)
    for (op, args), a, j in zip(cases, aot, jit, strict=True):
        pairs = zip(a, j, strict=True) if isinstance(a, tuple) else [(a, j)]
        assert all(torch.equal(x, y) for x, y in pairs), f"{name(op)}: AOT and JIT differ for {_shapes(args)}"
