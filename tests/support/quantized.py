"""Released-format checkpoints made from known weights: FP8 e4m3 with block scales, MXFP4 experts, FP8 Engram
tables, written beside their dequantized twin (the same model with each quantized weight replaced by its
dequantized fp32 value, computed here independently of DeepInfer's dequantization)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from tests.support.v4_fixtures import read_tensors, write_checkpoint

#: (format, block) of a weight: ("fp8", (rows, cols) block) or ("mxfp4", (1, 32)); None leaves it as it is.
Layout = Callable[[str, torch.Tensor], tuple[str, tuple[int, int]] | None]

#: Projections the released V4 checkpoints store in FP8 (compressor, indexer, embedding and head stay BF16).
V4_DENSE_QUANTIZED = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.", ".shared_experts.")


def v4_layout(expert_dtype: str, block: tuple[int, int]) -> Layout:
    """V4 as released: dense projections FP8 with ``block`` scales, routed experts MXFP4 or FP8."""

    def layout(name: str, w: torch.Tensor) -> tuple[str, tuple[int, int]] | None:
        expert = ".ffn.experts." in name
        if not name.endswith(".weight") or not (expert or any(p in name for p in V4_DENSE_QUANTIZED)):
            return None
        return ("mxfp4", (1, 32)) if expert and expert_dtype == "fp4" else ("fp8", block)

    return layout


V41_DENSE = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.", ".attn.indexer.wq_b.",
             ".shared_experts.", ".main_proj.")
V41_RELEASED = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


def v41_released_layout(name: str, w: torch.Tensor):
    """As released, except that odd layers' dense weights use 128x128 blocks (the per-tensor detection must find
    both); expert weights whose K is not a multiple of 32 (tiny dims) are FP8."""
    if not name.endswith(".weight"):
        return None
    if name.endswith("engram.embed.weight"):
        return "fp8", (1, 32)
    if ".ffn.experts." in name:
        return ("mxfp4", (1, 32)) if w.shape[1] % 32 == 0 else ("fp8", (32, 32))
    if any(p in name for p in V41_DENSE):
        return "fp8", (128, 128) if int(name.split(".")[1]) % 2 else (32, 32)
    return None


def released_tiny_v41(target: str | Path, fp8_engram: bool = True) -> tuple[Path, Path]:
    """The embedded tiny V4.1 (``deepinfer/assets/tiny_v41``, with its DSpark drafter) in the released layout:
    its dims fit every format, so every routed and draft expert is MXFP4, the dense projections (shared experts
    and ``main_proj`` included) FP8, the Engram tables FP8 (float if not ``fp8_engram``).  (quantized,
    dequantized twin) directories."""
    import deepinfer

    def layout(name: str, w: torch.Tensor):
        return None if not fp8_engram and name.endswith("engram.embed.weight") else v41_released_layout(name, w)

    source = Path(deepinfer.__file__).parent / "assets" / "tiny_v41"
    return quantize_checkpoint(source, target, layout, quantization_config=V41_RELEASED)


def rewrite_checkpoint(source: str | Path, target: str | Path, change: Callable[[dict[str, torch.Tensor]], None]
                       ) -> Path:
    """A copy of the single-file checkpoint ``source`` at ``target`` whose tensors ``change`` edited in place."""
    from safetensors.torch import load_file, save_file

    target = Path(target)
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(target / "model.safetensors"))
    return target


def quantize_checkpoint(source: str | Path, target: str | Path, layout: Layout, scale_format: str = "ue8m0",
                        quantization_config: dict | None = None) -> tuple[Path, Path]:
    """Quantize a saved checkpoint by ``layout``; writes ``target/quantized`` (with ``quantization_config`` in
    its config.json, at the top level) and ``target/dequantized``."""
    from deepinfer.quant import quantize_fp8_block, quantize_mxfp4

    source, target = Path(source), Path(target)
    config = json.loads((source / "config.json").read_text())
    quantized, dequantized = {}, {}
    for name, w in read_tensors(source).items():
        found = layout(name, w)
        if found is None:  # (a scale written for a quantized weight below is not overwritten)
            quantized.setdefault(name, w)
            dequantized.setdefault(name, w)
            continue
        fmt, block = found
        stem = name.removesuffix(".weight")
        if fmt == "mxfp4":
            q = quantize_mxfp4(w)
            quantized[name], quantized[stem + ".scale"] = q.data.view(torch.int8), q.scale  # packed as released
            dequantized[name] = _dequant_mxfp4(q.data, q.scale)
        else:
            q = quantize_fp8_block(w, block, scale_format)
            quantized[name], quantized[stem + ".scale"] = q.data, q.scale
            dequantized[name] = _dequant_fp8(q.data, q.scale, block)
    released = {**config, "quantization_config": quantization_config or {}}
    out = (write_checkpoint(target / "quantized", quantized, released),
           write_checkpoint(target / "dequantized", dequantized, config))
    for extra in source.iterdir():  # the tokenizer and generation config travel along
        if extra.suffix == ".json" and extra.name != "config.json" and extra.name.startswith(("tokenizer", "gen")):
            for directory in out:
                shutil.copy(extra, directory / extra.name)
    return out


def _dequant_fp8(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = data.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= scale[i, j].float()
    return out


def _dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    table = torch.tensor(magnitudes + [-m for m in magnitudes])
    low, high = table[(packed & 0xF).long()], table[(packed >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)
    return values * scale.float().repeat_interleave(32, dim=-1)


def fp8_prefill_emulation(ops):
    """``ops`` (an OpTable) with ``fp8_block_linear`` / ``fp8_block_grouped_linear`` replaced by a torch emulation of
    the CUDA kernels' prefill regime (bf16, >= 64 rows, K a multiple of block_k): x rounded to FP8 e4m3 per token
    and ``block_k`` channels (scale ``max(amax, 1e-4) / 448``) before the product; other calls as the reference.
    What the GPU's FP8 GEMMs should deviate by, measured on the CPU."""
    import torch.nn.functional as F

    from deepinfer.ops.quant import dequant_fp8_block

    def rounded(x: torch.Tensor, bk: int) -> torch.Tensor:
        m = x.reshape(x.shape[0], -1)
        if m.shape[0] < 64 or x.shape[-1] % bk or x.dtype != torch.bfloat16:
            return x.float()
        g = m.float().view(m.shape[0], -1, bk)
        s = g.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448
        return ((g / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).view(x.shape)

    def linear(x, weight, scale, block_n, block_k):
        w = dequant_fp8_block(weight, scale, block_n, block_k, torch.float32)
        flat = x.reshape(-1, x.shape[-1])
        return F.linear(rounded(flat, block_k), w).to(x.dtype).view(*x.shape[:-1], -1)

    def grouped(x, weight, scale, block_n, block_k):
        w = dequant_fp8_block(weight, scale, block_n, block_k, torch.float32)
        out = torch.einsum("tgk,gnk->tgn", rounded(x, block_k), w.view(x.shape[1], -1, x.shape[-1]))
        return out.to(x.dtype)

    ops.fp8_block_linear, ops.fp8_block_grouped_linear = linear, grouped
    return ops
