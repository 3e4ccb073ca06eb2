"""DEEPINFER_BATCH_INVARIANT=1: a request's logits do not depend on its batch (docs/reproducibility.md).

Per op: every op with rows passes the conformance property on the CPU backend (any sub-batch's rows equal the
whole batch's, bitwise), and each batch-invariant form still conforms to the plain reference.  Per model (a tiny
random V4, V4.1's tiny_b fixture): a needle sequence's logprobs are bitwise the same alone and among different
neighbours, at different places in the batch, in decode steps shared with others, and however its prompt is
chunked; the engine returns bitwise equal logprobs for it alone and in a chunked, mixed batch.  Negative control:
with the flag off the same comparisons differ here (measured: MKL's one-row GEMV rounds differently from its GEMM).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer import LLM, EngineArgs, SamplingParams
from deepinfer.backends.cpu import CpuBackend
from deepinfer.models import load_model
from deepinfer.ops import OpTable, op_defs
from deepinfer.testing import batch_invariance_params, check_batch_invariance, check_op
from tests.support.engine_checks import ragged_prompts
from tests.support.model_runs import run_chunked, run_ragged
from tests.support.v4_fixtures import (  # noqa: F401
    SMALL,
    build_engine_checkpoint,
    random_tokens,
    single_thread,
)
from tests.support.v41_fixtures import FIXTURES

FLAG = "DEEPINFER_BATCH_INVARIANT"

# --------------------------------------------------------------------------------------------------
# Ops: the conformance property, on the reference backend
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, dtype", batch_invariance_params())
def test_reference_op_is_batch_invariant(name, dtype):
    assert check_batch_invariance(CpuBackend(), name, dtype) > 0


@pytest.mark.parametrize("name", sorted(n for n, d in op_defs().items() if d.batch_invariant is not None))
def test_batch_invariant_form_conforms_to_the_reference(name, monkeypatch):
    monkeypatch.setenv(FLAG, "1")
    backend = CpuBackend()
    assert OpTable.for_backend(backend).batch_invariant
    assert getattr(OpTable.for_backend(backend), name) is op_defs()[name].batch_invariant
    for dtype in op_defs()[name].dtypes:
        assert check_op(backend, name, dtype) > 0


def _split_k_when_batched(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A plausible kernel bug: split-K (two partial sums) only when the batch is large enough."""
    if x.shape[0] < 4:
        return F.linear(x, weight)
    half = x.shape[-1] // 2
    return F.linear(x[..., :half], weight[:, :half]) + F.linear(x[..., half:], weight[:, half:])


class _SplitKBackend(CpuBackend):
    name = "split_k"
    batch_invariant_ops = ("linear",)  # a false claim

    def load_ops(self):
        return {"linear": _split_k_when_batched}


class _UndeclaredBackend(CpuBackend):
    name = "undeclared"

    def load_ops(self):
        from deepinfer.ops.quant import dequant_mxfp4
        from deepinfer.ops.sampling import filter_logits

        return {"filter_logits": filter_logits, "dequant_mxfp4": dequant_mxfp4}


def test_checker_rejects_a_batch_size_dependent_kernel():
    backend = _SplitKBackend()
    assert check_op(backend, "linear", torch.float32) > 0  # conforms within tolerance...
    with pytest.raises(AssertionError, match=r"split_k\.linear\(split_k\).*not bitwise equal"):
        check_batch_invariance(backend, "linear", torch.float32)  # ...but is not batch-invariant


def test_undeclared_overrides_with_rows_fall_back_under_the_flag(monkeypatch):
    monkeypatch.delenv(FLAG, raising=False)
    backend = _UndeclaredBackend()
    assert OpTable.for_backend(backend).source("filter_logits") == "undeclared"
    monkeypatch.setenv(FLAG, "1")
    table = OpTable.for_backend(backend)
    assert table.source("filter_logits") == "reference"  # not declared batch-invariant: not trusted
    assert table.source("dequant_mxfp4") == "undeclared"  # sees no batch: kept
    assert table.linear is op_defs()["linear"].batch_invariant


# --------------------------------------------------------------------------------------------------
# Model: a needle sequence among varied batches
# --------------------------------------------------------------------------------------------------

VOCAB = 384  # ids every model below has (the V4 checkpoint: its toy tokenizer's 400; V4.1's tiny_b: 384)
NEEDLE = random_tokens(40, VOCAB, 1)
OTHERS = [random_tokens(n, VOCAB, 50 + n) for n in (5, 23, 40, 9, 31)]


@pytest.fixture(scope="module", params=["deepseek_v4", "deepseek_v41"])
def checkpoint(request, tmp_path_factory):
    if request.param == "deepseek_v41":
        return FIXTURES / "tiny_b"
    directory, _ = build_engine_checkpoint(tmp_path_factory.mktemp("tiny_v4_bi"), SMALL, vocab_size=400)
    return directory


def _model(path, dtype: torch.dtype, invariant: bool):
    return load_model(path, ops=OpTable(batch_invariant=invariant), dtype=dtype, device=torch.device("cpu"))


def _needle_runs(model) -> dict[str, torch.Tensor]:
    """The needle's logprobs [40, V] under many batchings; the first is bs1 with the whole prompt."""
    runs = {"alone, whole prompt": run_chunked(model, NEEDLE, len(NEEDLE))}
    for chunk in (1, 3, 16):
        runs[f"alone, chunks of {chunk}"] = run_chunked(model, NEEDLE, chunk)
    for place in (0, 2, 5):
        seqs = OTHERS[:place] + [NEEDLE] + OTHERS[place:]
        runs[f"whole prompts together, needle at {place}"] = run_ragged(model, seqs, [[len(s) for s in seqs]])[place]
    seqs = OTHERS[:3] + [NEEDLE]  # token by token: decode steps shared with sequences of other lengths
    steps = [[1 if k < len(s) else 0 for s in seqs] for k in range(len(NEEDLE))]
    runs["decode steps with 3 neighbours"] = run_ragged(model, seqs, steps)[-1]
    seqs = [NEEDLE] + OTHERS[1:4]  # chunked prefill mixed with others' prefill and decode, joining late
    steps = [[10, 23, 0, 0], [1, 0, 40, 0], [29, 0, 0, 9]]
    runs["chunks 10+1+29 in a mixed batch"] = run_ragged(model, seqs, steps)[0]
    return runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_needle_logprobs_are_bitwise_equal_in_any_batch(checkpoint, dtype):
    runs = _needle_runs(_model(checkpoint, dtype, invariant=True))
    alone = runs.pop("alone, whole prompt")
    for how, logprobs in runs.items():
        diff = (logprobs - alone).abs().max().item()
        assert torch.equal(logprobs, alone), f"{how}: differs from bs1 by up to {diff:.3g}"


def _one_row_gemm_differs() -> bool:
    """Whether this CPU's fp32 GEMM gives a row other bits alone than among other rows (MKL's does)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, SMALL["hidden_size"], generator=gen), torch.randn(96, SMALL["hidden_size"], generator=gen)
    return not torch.equal(F.linear(x[:1], w), F.linear(x, w)[:1])


def test_negative_control_without_the_flag(checkpoint):
    """Flag off, fp32: the same batchings change the needle's logprobs; the property above is not vacuous."""
    if not _one_row_gemm_differs():
        pytest.skip("this CPU's fp32 GEMM rounds one row like many: no batch variance to control against")
    runs = _needle_runs(_model(checkpoint, torch.float32, invariant=False))
    alone = runs.pop("alone, whole prompt")
    differ = [how for how, logprobs in runs.items() if not torch.equal(logprobs, alone)]
    assert "alone, chunks of 1" in differ and "decode steps with 3 neighbours" in differ, differ
    close = max((logprobs - alone).abs().max().item() for logprobs in runs.values())
    assert close < 1e-4  # rounding, not a bug


def test_needle_is_invariant_with_two_threads(checkpoint):
    """Thread splits are a function of shape too: the fixed-shape references hold with 2 threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = _model(checkpoint, torch.float32, invariant=True)
        alone = run_chunked(model, NEEDLE, len(NEEDLE))
        seqs = [NEEDLE] + OTHERS[1:3]  # a chunk among neighbours, a one-row step alone, then the rest
        together = run_ragged(model, seqs, [[7, 23, 40], [1, 0, 0], [32, 0, 0]])[0]
        assert torch.equal(together, alone)
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# Engine: what a user sees
# --------------------------------------------------------------------------------------------------


def _engine_needle(checkpoint, batched: bool, **limits):
    params = SamplingParams(temperature=1.0, seq_seed=7, max_tokens=6, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    needle = random_tokens(60, VOCAB, 2).tolist()  # its output crosses the state's 64-token page boundary
    llm = LLM(str(checkpoint), dtype="float32", **limits)
    if not batched:
        return llm.generate([needle], params, use_tqdm=False)[0]
    others = ragged_prompts(VOCAB, lengths=[62, 3, 58, 17, 61, 33], seed=3)
    other_params = [SamplingParams(temperature=0.8, seed=i, max_tokens=6 + i, ignore_eos=True) for i in range(6)]
    outs = llm.generate(others[:2] + [needle] + others[2:], other_params[:2] + [params] + other_params[2:],
                        use_tqdm=False)
    assert "state_cache_bytes" not in limits or llm.engine.num_preemptions > 0
    return outs[2]


def _flat_logprobs(out) -> list[float]:
    values = [e[t].logprob for e in out.prompt_logprobs[1:] for t in sorted(e)]
    values += [e[t].logprob for e in out.outputs[0].logprobs for t in sorted(e)]
    return values


@pytest.mark.parametrize("how", ["chunked", "preempted"])
def test_engine_logprobs_are_bitwise_equal_alone_and_batched(checkpoint, monkeypatch, how):
    monkeypatch.setenv(FLAG, "1")
    alone = _engine_needle(checkpoint, batched=False)
    limits = dict(max_num_batched_tokens=24)  # chunked prefill mixed with decode steps
    if how == "preempted":  # room for two prompts: sequences growing past 64 tokens preempt and recompute
        model = _model(checkpoint, torch.float32, invariant=True)
        limits["state_cache_bytes"] = model.state_pool_bytes(EngineArgs().max_num_seqs, 62, sequences=2)
    batched = _engine_needle(checkpoint, batched=True, **limits)
    assert batched.outputs[0].token_ids == alone.outputs[0].token_ids
    assert _flat_logprobs(batched) == _flat_logprobs(alone)  # exact float equality
    assert batched.outputs[0].cumulative_logprob == alone.outputs[0].cumulative_logprob


def test_engine_negative_control_without_the_flag(checkpoint, monkeypatch):
    if not _one_row_gemm_differs():
        pytest.skip("this CPU's fp32 GEMM rounds one row like many: no batch variance to control against")
    monkeypatch.setenv(FLAG, "0")
    alone = _engine_needle(checkpoint, batched=False)
    batched = _engine_needle(checkpoint, batched=True, max_num_batched_tokens=24)
    diffs = [abs(a - b) for a, b in zip(_flat_logprobs(batched), _flat_logprobs(alone), strict=True)]
    assert 0 < max(diffs) < 1e-4
