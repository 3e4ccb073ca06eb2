"""What each CUDA kernel covers, declared per op (``CudaBackend.op_coverage``); the op table runs core's reference
for everything else, so a checkpoint with, say, 3 hyper-connection streams runs on this backend (slower there).

Each predicate takes its op's arguments (the reference's signature, checked when the table is built) and reads
shapes and plain arguments only: it runs before every call.  The kernels' ``prepare`` raise a ValueError for what
these refuse (tools and tests call ``prepare`` directly).  No Triton import here: the declarations load and test
without a GPU.

The kernels' other ValueErrors are real errors and stay so: an unknown router scoring function (the reference
refuses it too), windows whose shapes do not match (bad input), a split that is no multiple of its tile (a bug in
``arch.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def rope_fits(inv_freq: torch.Tensor, dim: int) -> bool:
    """Every kernel that rotates takes its rope channels as one tile of pairs: a power-of-two count (or none), at most
    half of the row's ``dim`` channels."""
    half = inv_freq.numel()
    return half & (half - 1) == 0 and 2 * half <= dim


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, sinkhorn_iters: int) -> bool:
    """The streams are one tile (a power-of-two count; 1, 2, 4 and 8 ran on an H200); one Sinkhorn round or more."""
    return is_pow2(streams.shape[1]) and sinkhorn_iters >= 1


def hc_pre_single_pass(streams: torch.Tensor, previous_pre: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                       scale: torch.Tensor, norm_eps: float, hc_eps: float, sinkhorn_iters: int) -> bool:
    """As :func:`hc_pre` (the same kernels)."""
    return hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> bool:
    """The streams are one tile: a power-of-two count."""
    return is_pow2(streams.shape[1])


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
         inverse: bool = False) -> bool:
    return rope_fits(inv_freq, x.shape[-1])


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                  inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> bool:
    return rope_fits(inv_freq, x.shape[-1])


def sparse_attention_inverse_rope(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor,
                                  scale: float, positions: torch.Tensor, inv_freq: torch.Tensor,
                                  attention_scaling: float = 1.0) -> bool:
    return rope_fits(inv_freq, q.shape[-1])


def sparse_attention_packed_inverse_rope(q: torch.Tensor, rings: torch.Tensor, entries: torch.Tensor,
                                         entry_base: int, indices: torch.Tensor, sinks: torch.Tensor, scale: float,
                                         positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                                         ring_block: int, entry_block: int, entry_scale_format: str) -> bool:
    """A packed row decodes as one power-of-two tile of channels (>= 32), in scale blocks of 16 or 32."""
    dim = q.shape[-1]
    return (rope_fits(inv_freq, dim) and is_pow2(dim) and dim >= 32 and ring_block in (16, 32)
            and entry_block in (16, 32))


def packed_keys_fit(q: torch.Tensor, key_block: int) -> bool:
    """The indexer's packed keys decode as one power-of-two tile of channels (>= 16), in blocks of 16 or 32."""
    dim = q.shape[-1]
    return is_pow2(dim) and dim >= 16 and key_block in (16, 32) and dim % key_block == 0


def indexer_topk_packed(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, key_rows: torch.Tensor,
                        key_block: int, key_scale_format: str, seq_ids: torch.Tensor, limits: torch.Tensor,
                        topk: int, softmax_scale: float, weights_scale: float) -> bool:
    return packed_keys_fit(q, key_block)


def indexer_candidates_packed(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor,
                              key_rows: torch.Tensor, key_block: int, key_scale_format: str, seq_ids: torch.Tensor,
                              limits: torch.Tensor, topk: int, softmax_scale: float, weights_scale: float,
                              block_size: int, topk_blocks: int) -> bool:
    return packed_keys_fit(q, key_block)


def indexer_topk_in_blocks_packed(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor,
                                  key_rows: torch.Tensor, key_block: int, key_scale_format: str,
                                  seq_ids: torch.Tensor, limits: torch.Tensor, topk: int, softmax_scale: float,
                                  weights_scale: float, blocks: torch.Tensor, block_size: int) -> bool:
    return packed_keys_fit(q, key_block)


def compress_entries(window: torch.Tensor, previous: torch.Tensor | None, has_previous: torch.Tensor | None,
                     position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     inv_freq: torch.Tensor, rope_scaling: float, needed: torch.Tensor | None = None) -> bool:
    """An even entry width (each program splits its row into pairs) whose rope channels fit one tile."""
    width = position_bias.shape[-1]
    dim = width // 2 if previous is not None else width
    return dim % 2 == 0 and rope_fits(inv_freq, dim)


def _quant_block_fits(block: int, inv_freq: torch.Tensor, dim: int) -> bool:
    """A fused quantizer's blocks in the rotating kernels' epilogue: whole blocks of a power of two in the rope
    channels (and so in the rest), when the row is whole blocks; otherwise nothing is quantized."""
    if not rope_fits(inv_freq, dim) or block < 1:
        return False
    return dim % block != 0 or (is_pow2(block) and (2 * inv_freq.numel()) % block == 0)


def rms_norm_rope_fp8_e4m3_fake_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                                      positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                                      block: int) -> bool:
    return _quant_block_fits(block, inv_freq, x.shape[-1])


def rope_fp4_e2m1_fake_quant(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                             attention_scaling: float, block: int, scale_format: str) -> bool:
    return _quant_block_fits(block, inv_freq, x.shape[-1])


#: Ops whose kernel covers only some inputs; the other overrides take everything their reference does.
COVERAGE: dict[str, Callable[..., bool]] = {
    "hc_pre": hc_pre,
    "hc_pre_single_pass": hc_pre_single_pass,
    "hc_post": hc_post,
    "rope": rope,
    "rms_norm_rope": rms_norm_rope,
    "sparse_attention_inverse_rope": sparse_attention_inverse_rope,
    "sparse_attention_packed_inverse_rope": sparse_attention_packed_inverse_rope,
    "compress_entries": compress_entries,
    "indexer_topk_packed": indexer_topk_packed,
    "indexer_candidates_packed": indexer_candidates_packed,
    "indexer_topk_in_blocks_packed": indexer_topk_in_blocks_packed,
    "rms_norm_rope_fp8_e4m3_fake_quant": rms_norm_rope_fp8_e4m3_fake_quant,
    "rope_fp4_e2m1_fake_quant": rope_fp4_e2m1_fake_quant,
}

