"""On the GPU: the CUDA backend's op table under ``DEEPINFER_BATCH_INVARIANT=1`` is batch-invariant, op by op.

The table holds the backend's kernels it declares batch-invariant (``CudaBackend.batch_invariant_ops``) and
core's batch-invariant references, running on the GPU, for everything else.  Skipped without a GPU (CI);
run on the GPU host with ``pytest tests/backend_cuda -q``.  See docs/reproducibility.md.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.testing import batch_invariance_params, check_batch_invariance
from deepinfer_cuda.plugin import CudaBackend

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("op_name, dtype", batch_invariance_params())
def test_batch_invariance(op_name, dtype):
    assert check_batch_invariance(CudaBackend(), op_name, dtype) > 0


#: Ops whose wrapper runs a cuBLAS GEMM first: cuBLAS picks its kernel (and reduction order) by the number of rows,
#: so they are not declared batch-invariant (H200: fp32 weights move by 1 ulp between 1 and 5 rows).
BEHIND_A_CUBLAS_GEMM = {
    "moe_router": "the router GEMM is cuBLAS; under DEEPINFER_BATCH_INVARIANT=1 core's tiled reference routes",
    "moe_hash_router": "the router GEMM is cuBLAS; under DEEPINFER_BATCH_INVARIANT=1 core's tiled reference routes",
}


class _AllKernelsClaimed(CudaBackend):
    """Every kernel the backend has, claimed: shows which of them could be declared batch-invariant."""

    @property
    def batch_invariant_ops(self):
        return tuple(self.load_ops())


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("op_name", sorted(CudaBackend().load_ops()) if torch.cuda.is_available() else [])
def test_each_cuda_kernel_is_batch_invariant(op_name):
    if op_name in BEHIND_A_CUBLAS_GEMM:  # their Triton kernel is row-local; the GEMM in front of it is not
        assert op_name not in CudaBackend.batch_invariant_ops
        pytest.skip(BEHIND_A_CUBLAS_GEMM[op_name])
    backend = _AllKernelsClaimed()
    for name, dtype in batch_invariance_params(ops=[op_name]):
        assert check_batch_invariance(backend, name, dtype) > 0
