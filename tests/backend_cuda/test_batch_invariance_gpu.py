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
        assert op_name not in CudaBackend().batch_invariant_ops
        pytest.skip(BEHIND_A_CUBLAS_GEMM[op_name])
    backend = _AllKernelsClaimed()
    for name, dtype in batch_invariance_params(ops=[op_name]):
        assert check_batch_invariance(backend, name, dtype) > 0


@requires_cuda
@pytest.mark.cuda
def test_decode_graphs_capture_under_the_flag(tmp_path, monkeypatch):
    """Under the flag the decode step is captured, not run eagerly (issue: core's batch-invariant MoE reference
    synchronised with the host, so capture failed; the backend's fixed-tile MoE kernel replaces it), and a
    sequence's outputs are bitwise the same alone and in a batch."""
    from deepinfer import LLM, SamplingParams
    from tests.support.engine_checks import ragged_prompts
    from tests.support.v4_fixtures import SMALL, build_engine_checkpoint

    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    directory, _ = build_engine_checkpoint(tmp_path, SMALL)
    params = SamplingParams(temperature=1.0, seq_seed=7, max_tokens=12, logprobs=3, ignore_eos=True)
    llm = LLM(str(directory), dtype="bfloat16")
    prompts = ragged_prompts(llm.engine.model.vocab_size, lengths=[30, 5, 44, 17], seed=4)
    alone = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    batched = llm.generate(prompts, params, use_tqdm=False)[0]
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.eager_reason is None and graphs._graphs
    assert batched.outputs[0].token_ids == alone.outputs[0].token_ids
    for a, b in zip(batched.outputs[0].logprobs, alone.outputs[0].logprobs, strict=True):
        assert {t: e.logprob for t, e in a.items()} == {t: e.logprob for t, e in b.items()}
