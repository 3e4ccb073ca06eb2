"""The released weight and KV formats end to end on the GPU (``LLM`` on ``DEEPINFER_ACCELERATOR=nvidia``).

- ``DEEPINFER_QUANTIZED_KV=1``: V4.1's state stored packed (``tiny_a``: every format fits its dims) gives the same
  prompt logprobs and the same greedy tokens and logprobs, with decode graphs, as the fake-quantized bf16 state,
  bit for bit (the model fake-quantizes exactly where the state stores).
- ``DEEPINFER_QUANTIZED_WEIGHTS=native``: a released-format checkpoint (V4.1 ``tiny_b`` with FP8 32x32 / 128x128
  projections; V4 with MXFP4 or FP8 experts and FP8 projections) runs its FP8 / MXFP4 kernels and agrees with the same
  checkpoint dequantized at load: fp32 within ``FP32_TOL`` (weight-only dequantization, no activation rounding);
  bf16 prefill of >= 64 rows quantizes activations to FP8 (``fp8_block_linear``'s tolerance), which moves a random
  tiny model's logprobs a lot (CPU emulation on ``tiny_b``: mean |Δ| 0.27): the GPU's mean |Δ| must stay within
  1.5x the CPU emulation's, measured in the run, + ``BF16_SLACK``.  Decode graphs are captured.
Skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.support.quantized import V41_RELEASED, quantize_checkpoint, v4_layout, v41_released_layout
from tests.support.v41_fixtures import FIXTURES, references

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs an NVIDIA GPU: runs the engine on DEEPINFER_ACCELERATOR=nvidia (GPU host: pytest tests/backend_cuda)")
pytestmark = [requires_cuda, pytest.mark.cuda]

FP32_TOL = 1e-3
BF16_SLACK = 0.05


@pytest.fixture(autouse=True)
def nvidia(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")


def _run(path, dtype: str, prompts: list[list[int]], eager: bool = False):
    llm = LLM(str(path), dtype=dtype, enforce_eager=eager)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    prompt = [torch.tensor([o.prompt_logprobs[p][t].logprob for p, t in enumerate(ids) if p])
              for o, ids in zip(outs, prompts, strict=True)]
    decoded = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                       o.outputs[0].token_ids, strict=True)])
               for o in outs]
    return llm, prompt, decoded


def test_packed_kv_state_is_bit_for_bit_the_fake_quantized_state(monkeypatch):
    prompts = [r.tokens[:n].tolist() for r, n in zip(references("tiny_a"), [200, 64, 17, 130], strict=True)]
    runs = {}
    for packed in (True, False):
        monkeypatch.setenv("DEEPINFER_QUANTIZED_KV", "1" if packed else "0")
        llm, prompt, decoded = _run(FIXTURES / "tiny_a", "bfloat16", prompts)
        pool = llm.engine.model.pool
        assert any(t.dtype == torch.uint8 for t in pool.tensors.values()) == packed
        assert llm.engine.runner.decode_graphs is not None and llm.engine.runner.decode_graphs._graphs
        runs[packed] = (prompt, decoded, pool.nbytes())
    for a, b in zip(runs[True][0], runs[False][0], strict=True):
        assert torch.equal(a, b), f"prompt logprobs differ by up to {float((a - b).abs().max()):.3g}"
    assert runs[True][1] == runs[False][1], "decoded tokens or logprobs differ"


def _released_v41(tmp_path):
    return quantize_checkpoint(FIXTURES / "tiny_b", tmp_path / "v41", v41_released_layout,
                               quantization_config=V41_RELEASED)


def _released_v4(tmp_path, expert_dtype: str = "fp4"):
    from tests.support.v4_fixtures import SMALL, build_engine_checkpoint

    source, _ = build_engine_checkpoint(tmp_path / "v4src", SMALL, seed=7)
    config = {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": expert_dtype}
    return quantize_checkpoint(source, tmp_path / "v4", v4_layout(expert_dtype, (32, 32)), "ue8m0", config)


@pytest.mark.parametrize("model, dtype", [("v41", "float32"), ("v41", "bfloat16"), ("v4", "float32"),
                                          ("v4-fp8-experts", "float32")])
def test_native_weights_agree_with_the_dequantized_load(tmp_path, monkeypatch, model, dtype):
    """V4.1: FP8 projections of both block sizes, both GEMM regimes in bf16; V4: MXFP4 experts, or FP8 experts
    (32x32 blocks: they stay FP8, ``moe_experts_fp8``)."""
    if model == "v41":
        quantized, _ = _released_v41(tmp_path)
    else:
        quantized, _ = _released_v4(tmp_path, "fp8" if model == "v4-fp8-experts" else "fp4")
    if model == "v41":  # (bf16: prompts of >= 64 rows, so the CPU emulation runs the GPU's regime too)
        lengths = [200, 64] if dtype == "bfloat16" else [200, 64, 9]
        prompts = [r.tokens[:n].tolist() for r, n in zip(references("tiny_b"), lengths, strict=False)]
    else:
        prompts = [list(range(3, 3 + n)) for n in (100, 70, 9)]
    monkeypatch.setenv("DEEPINFER_QUANTIZED_WEIGHTS", "dequantize")
    _, dense_prompt, _ = _run(quantized, dtype, prompts)
    monkeypatch.setenv("DEEPINFER_QUANTIZED_WEIGHTS", "native")
    llm, native_prompt, decoded = _run(quantized, dtype, prompts)
    ops = llm.engine.model.ops
    assert ops.source("fp8_block_linear") == "nvidia"
    if model != "v41":
        ffn, fp8 = llm.engine.model.layers[2].ffn, model == "v4-fp8-experts"
        assert ops.source("moe_experts_fp8" if fp8 else "moe_experts_mxfp4") == "nvidia" and ffn.scales is not None
        assert ffn.fp8_block == ((32, 32) if fp8 else None)
    assert llm.engine.runner.decode_graphs is not None and llm.engine.runner.decode_graphs._graphs
    assert all(len(tokens) == 16 for tokens, _ in decoded)
    limits = _cpu_emulation_errors(quantized, prompts) if dtype == "bfloat16" else None
    for i, (a, b) in enumerate(zip(native_prompt, dense_prompt, strict=True)):
        err = (a - b).abs()
        if limits is None:
            assert float(err.max()) <= FP32_TOL, f"max |Δ logprob| {float(err.max()):.3g}"
        else:
            limit = 1.5 * limits[i] + BF16_SLACK
            assert float(err.mean()) <= limit, f"prompt {i}: mean |Δ logprob| {float(err.mean()):.3g} > {limit:.3g}"


def _cpu_emulation_errors(path, prompts: list[list[int]]) -> list[float]:
    """Per prompt, the mean |Δ logprob| the FP8 activation rounding causes on the CPU (bf16, native weights, the
    reference ops against their emulation of the GPU's prefill regime)."""
    from deepinfer.models import load_model
    from deepinfer.ops import OpTable
    from tests.support.model_runs import run_chunked
    from tests.support.quantized import fp8_prefill_emulation

    def logprobs(ops) -> list[torch.Tensor]:
        model = load_model(path, ops=ops, dtype=torch.bfloat16, device=torch.device("cpu"))
        out = []
        for ids in prompts:
            tokens = torch.tensor(ids)
            lp = run_chunked(model, tokens, len(ids))
            out.append(lp[:-1].gather(1, tokens[1:, None]).squeeze(1))
        return out

    exact, emulated = logprobs(OpTable()), logprobs(fp8_prefill_emulation(OpTable()))
    return [float((a - b).abs().mean()) for a, b in zip(exact, emulated, strict=True)]
