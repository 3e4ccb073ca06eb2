"""GPU checks shared by tests/backend_cuda's kernel tests (V4, quantized, V4.1): a kernel set's AOT cubins compute
what Triton's JIT does, bit for bit, and calls at the model's shapes find a cubin (nothing JITs); decode-sized
calls make no host synchronisation and replay from a CUDA graph to the eager bits.  Imports the CUDA backend only
when called, so their modules import on the CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

#: (the op or kernel module a case calls, its arguments)
Case = tuple[Any, tuple]


def _shapes(args: tuple) -> list[Any]:
    return [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]


def _bitwise_equal(a: Any, b: Any) -> bool:
    """Outputs (a tensor or a tuple of tensors) equal bit for bit."""
    pairs = zip(a, b, strict=True) if isinstance(a, tuple) else [(a, b)]
    return all(torch.equal(x, y) for x, y in pairs)


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
        assert _bitwise_equal(a, j), f"{name(op)}: AOT and JIT differ for {_shapes(args)}"


def assert_graph_replays_without_syncs(cases: Sequence[Case], call: Callable[[Any, tuple], Any], *,
                                       max_rows: int = 64) -> None:
    """Decode steps are captured: each case whose first argument has at most ``max_rows`` rows runs once eagerly
    (compiling outside the checks), once under ``torch.cuda.set_sync_debug_mode("error")`` (no host sync), and
    once captured through the CUDA backend's graph service, whose replay must give the eager bits."""
    from deepinfer_cuda.plugin import CudaBackend

    backend = CudaBackend()
    for op, args in cases:
        if args[0].shape[0] > max_rows:
            continue
        eager = call(op, args)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call(op, args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out: list = []
        with backend.graph_capture(backend.device()) as capture:
            replay = capture(lambda op=op, args=args, out=out: out.append(call(op, args)))
        replay()
        torch.cuda.synchronize()
        assert _bitwise_equal(out[-1], eager), f"{op}: graph replay differs from eager for {_shapes(args)}"
