"""Triton kernels of the CUDA backend, one module per op; importing this package imports Triton.

:data:`ALL` lists every kernel the kernel-set builder compiles ahead of time; :data:`TILELANG` the TileLang
kernels it adds where TileLang and nvcc are installed (an optional step; importing them needs no TileLang).
"""

from __future__ import annotations

from deepinfer_cuda.kernel_set.dispatch import TritonKernel
from deepinfer_cuda.kernel_set.tilelang_kernel import TileLangKernel
from deepinfer_cuda.kernels import (
                                    compress_entries,
                                    compress_pool,
                                    embedding_fp8,
                                    engram_gate,
                                    engram_hash,
                                    fp4_e2m1_fake_quant,
                                    fp4_e2m1_pack,
                                    fp4_e2m1_unpack,
                                    fp8_block_linear,
                                    fp8_e4m3_fake_quant,
                                    fp8_e4m3_pack,
                                    fp8_e4m3_unpack,
                                    hc_collapse,
                                    hc_post,
                                    hc_pre,
                                    indexer_topk,
                                    indexer_topk_in_blocks,
                                    indexer_topk_in_blocks_packed,
                                    indexer_topk_packed,
                                    moe_experts,
                                    moe_experts_fp8,
                                    moe_experts_mxfp4,
                                    moe_experts_mxfp4_scaled,
                                    moe_experts_mxfp4_tl,
                                    moe_hash_router,
                                    moe_router,
                                    moe_routing,
                                    rms_norm,
                                    rms_norm_rope,
                                    rms_norm_rope_fp8_e4m3_fake_quant,
                                    rope,
                                    rope_fp4_e2m1_fake_quant,
                                    sample_tokens,
                                    sparse_attention,
                                    sparse_attention_packed,
                                    split_k_sum,
                                    verify_drafts,
)

ALL: tuple[TritonKernel, ...] = (
    rms_norm.KERNEL, rope.KERNEL, rms_norm_rope.KERNEL, hc_pre.MIX_KERNEL, hc_pre.KERNEL, hc_post.KERNEL,
    hc_pre.SINGLE_PASS_KERNEL, hc_collapse.KERNEL,
    moe_routing.PLAN_KERNEL, moe_routing.COUNT_KERNEL, moe_routing.SCAN_KERNEL, moe_routing.SCATTER_KERNEL,
    moe_experts.UP_KERNEL, moe_experts.DOWN_KERNEL, moe_experts.COMBINE_KERNEL,
    sparse_attention.KERNEL, sparse_attention.COMBINE_KERNEL, indexer_topk.KERNEL, compress_pool.KERNEL,
    indexer_topk_in_blocks.KERNEL,
    compress_entries.KERNEL, sample_tokens.KERNEL, moe_router.KERNEL, moe_hash_router.KERNEL,
    fp8_e4m3_fake_quant.KERNEL, fp4_e2m1_fake_quant.KERNEL, engram_hash.KERNEL, engram_gate.KERNEL,
    rms_norm_rope_fp8_e4m3_fake_quant.KERNEL, rope_fp4_e2m1_fake_quant.KERNEL,
    fp8_block_linear.KERNEL, fp8_block_linear.ACT_QUANT_KERNEL, fp8_block_linear.MX_KERNEL,
    moe_experts_mxfp4.UP_KERNEL, moe_experts_mxfp4.DOWN_KERNEL, moe_experts_mxfp4_scaled.UP_KERNEL,
    moe_experts_mxfp4_scaled.DOWN_KERNEL, fp8_e4m3_pack.KERNEL, fp8_e4m3_unpack.KERNEL, fp4_e2m1_pack.KERNEL,
    fp4_e2m1_unpack.KERNEL, split_k_sum.KERNEL, sparse_attention_packed.KERNEL, indexer_topk_packed.KERNEL,
    indexer_topk_in_blocks_packed.KERNEL, embedding_fp8.KERNEL, moe_experts_fp8.UP_KERNEL, moe_experts_fp8.DOWN_KERNEL,
    verify_drafts.STATS_KERNEL, verify_drafts.KERNEL, verify_drafts.PICK_KERNEL,
)

TILELANG: tuple[TileLangKernel, ...] = (moe_experts_mxfp4_tl.UP_KERNEL, moe_experts_mxfp4_tl.DOWN_KERNEL)
