"""The kernels' math on the CPU: every overridden op's Triton kernel, run by Triton's interpreter on core's
conformance samples, against the reference op.  CI has no GPU; this is what proves the kernels there.

Runs in subprocesses because ``TRITON_INTERPRET=1`` must be set before Triton decorates the kernels: one a core
this process may use (at most 4), each taking the next unclaimed op, the largest samples first (the interpreter is
single-threaded).
libdevice calls have no interpreter implementation, so the script swaps them for ``tl`` equivalents, and kernels
with an ``INTERPRETED`` switch multiply in fp32 and round to bf16 by hand (the interpreter computes bf16 ``tl.dot``
wrongly and truncates fp32 -> bf16; bf16 products are exact in fp32, so the function checked is the same).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import importlib, os, sys, types
    import torch
    import triton.language as tl
    from deepinfer.ops import op_defs
    from deepinfer.testing.conformance import assert_close, samples
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.ops import coverage, kernels_by_op

    torch.set_num_threads(1)
    defs, OVERRIDES, COVERAGE = op_defs(), kernels_by_op(), coverage()
    for name in sorted(OVERRIDES):  # every kernel module first: a kernel may call another module's jitted helpers
        module = importlib.import_module(OVERRIDES[name].__module__)  # the kernel module the op's wrapper is in
        # the module of the kernel's Triton function too: a fused op runs another op's kernel with an epilogue
        # (a module without a KERNEL of its own chains other modules' kernels, patched as their ops are)
        own = getattr(module, "KERNEL", None)
        for m in {module} | ({importlib.import_module(own.jit_fn.fn.__module__)} if own else set()):
            if hasattr(m, "libdevice"):
                m.libdevice = types.SimpleNamespace(cos=lambda x: tl.cos(x), sin=lambda x: tl.sin(x),
                                                    log=lambda x: tl.log(x), exp=lambda x: tl.exp(x))
    def sample_size(name):  # elements in the op's samples: a rough cost under the interpreter
        op = defs[name]
        return sum(t.numel() for dtype in op.dtypes for case in samples(op, dtype, seed=1)
                   for t in case.args if isinstance(t, torch.Tensor))

    claims = sys.argv[1]
    for name in sorted(OVERRIDES, key=sample_size, reverse=True):
        try:  # the first process to create the op's file checks it: no process idles while another has a queue
            os.close(os.open(os.path.join(claims, name), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        module = importlib.import_module(OVERRIDES[name].__module__)
        if hasattr(module, "INTERPRETED"):  # kernels that work around the interpreter's bf16 dot and casts
            module.INTERPRETED = True
        op, checked = defs[name], 0
        for dtype in op.dtypes:
            for case in samples(op, dtype, seed=1):
                if name in COVERAGE and not COVERAGE[name](*case.args, **case.kwargs):
                    continue  # the table runs the reference for these (test_coverage.py)
                plan = module.prepare(*case.args, **case.kwargs, arch=SM90A)
                chained = hasattr(plan, "steps")  # a LaunchChain: several kernels, then finish()
                for kernel, launch in (plan.steps if chained else [(module.KERNEL, plan)]):
                    if all(g > 0 for g in launch.grid):
                        kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                                   num_stages=launch.config.num_stages)
                result = plan.finish() if chained else plan.result
                expected = op.reference(*case.args, **case.kwargs)
                if op.compare is not None:
                    op.compare(result, expected, case, dtype)
                else:
                    assert_close(result, expected, dtype, op.tolerances.get(dtype, (0.0, 0.0)), f"{name}[{case.label}]")
                checked += 1
        print("OK", name, checked)
    """
)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a GPU is present: test_gpu_kernels.py checks the compiled kernels themselves (Triton 3.6's "
                           "interpreter also fails on numpy 2.5 there: 1-element scalar arrays in range())")
def test_every_override_matches_the_reference_under_the_triton_interpreter(tmp_path):
    from deepinfer_cuda.ops import kernels_by_op

    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    workers = max(1, min(4, len(os.sched_getaffinity(0))))
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(workers)]
    checked: dict[str, str] = {}
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out + err[-4000:]
        checked.update(line.split()[1:] for line in out.splitlines() if line.startswith("OK "))
    assert set(checked) == set(kernels_by_op()) and all(int(n) > 0 for n in checked.values()), checked
