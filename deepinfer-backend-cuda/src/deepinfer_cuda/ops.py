"""Kernels that override core's reference ops, by op name.  Imported only once the backend is chosen.

Each value takes exactly the reference op's arguments (see deepinfer/ops/; the op table checks names, kinds and
defaults when it is built) and returns the same shapes and dtypes; ``tests/backend_cuda`` runs core's conformance
suite on every entry.  Some kernels cover only some shapes: ``deepinfer_cuda.coverage`` declares which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepinfer_cuda.kernels.compress_entries import compress_entries
from deepinfer_cuda.kernels.compress_pool import compress_pool
from deepinfer_cuda.kernels.embedding_fp8 import embedding_fp8
from deepinfer_cuda.kernels.engram_gate import engram_gate
from deepinfer_cuda.kernels.engram_hash import engram_hash
from deepinfer_cuda.kernels.fp4_e2m1_fake_quant import fp4_e2m1_fake_quant
from deepinfer_cuda.kernels.fp4_e2m1_pack import fp4_e2m1_pack
from deepinfer_cuda.kernels.fp4_e2m1_unpack import fp4_e2m1_unpack
from deepinfer_cuda.kernels.fp8_block_grouped_linear import (
    fp8_block_grouped_linear,
    fp8_block_grouped_linear_fixed_tiles,
)
from deepinfer_cuda.kernels.fp8_block_linear import fp8_block_linear, fp8_block_linear_fixed_tiles
from deepinfer_cuda.kernels.fp8_e4m3_fake_quant import fp8_e4m3_fake_quant
from deepinfer_cuda.kernels.fp8_e4m3_pack import fp8_e4m3_pack
from deepinfer_cuda.kernels.fp8_e4m3_unpack import fp8_e4m3_unpack
from deepinfer_cuda.kernels.hc_collapse import hc_collapse
from deepinfer_cuda.kernels.hc_post import hc_post
from deepinfer_cuda.kernels.hc_pre import hc_pre
from deepinfer_cuda.kernels.hc_pre_single_pass import hc_pre_single_pass
from deepinfer_cuda.kernels.indexer_candidates import indexer_candidates
from deepinfer_cuda.kernels.indexer_candidates_packed import indexer_candidates_packed
from deepinfer_cuda.kernels.indexer_topk import indexer_topk
from deepinfer_cuda.kernels.indexer_topk_in_blocks import indexer_topk_in_blocks
from deepinfer_cuda.kernels.indexer_topk_in_blocks_packed import indexer_topk_in_blocks_packed
from deepinfer_cuda.kernels.indexer_topk_packed import indexer_topk_packed
from deepinfer_cuda.kernels.moe_experts import moe_experts, moe_experts_fixed_tiles
from deepinfer_cuda.kernels.moe_experts_fp8 import moe_experts_fp8, moe_experts_fp8_fixed_tiles
from deepinfer_cuda.kernels.moe_experts_mxfp4 import moe_experts_mxfp4, moe_experts_mxfp4_fixed_tiles
from deepinfer_cuda.kernels.moe_hash_router import moe_hash_router
from deepinfer_cuda.kernels.moe_router import moe_router
from deepinfer_cuda.kernels.rms_norm import rms_norm
from deepinfer_cuda.kernels.rms_norm_rope import rms_norm_rope
from deepinfer_cuda.kernels.rms_norm_rope_fp8_e4m3_fake_quant import rms_norm_rope_fp8_e4m3_fake_quant
from deepinfer_cuda.kernels.rope import rope
from deepinfer_cuda.kernels.rope_fp4_e2m1_fake_quant import rope_fp4_e2m1_fake_quant
from deepinfer_cuda.kernels.sample_tokens import sample_tokens
from deepinfer_cuda.kernels.sparse_attention import sparse_attention, sparse_attention_inverse_rope
from deepinfer_cuda.kernels.sparse_attention_packed import sparse_attention_packed_inverse_rope
from deepinfer_cuda.kernels.verify_drafts import verify_drafts

OVERRIDES: dict[str, Callable[..., Any]] = {
    "rms_norm": rms_norm,
    "rope": rope,
    "rms_norm_rope": rms_norm_rope,
    "hc_pre": hc_pre,
    "hc_post": hc_post,
    "hc_pre_single_pass": hc_pre_single_pass,
    "hc_collapse": hc_collapse,
    "moe_experts": moe_experts,
    "moe_router": moe_router,
    "moe_hash_router": moe_hash_router,
    "sparse_attention": sparse_attention,
    "sparse_attention_inverse_rope": sparse_attention_inverse_rope,
    "sparse_attention_packed_inverse_rope": sparse_attention_packed_inverse_rope,
    "indexer_topk": indexer_topk,
    "indexer_candidates": indexer_candidates,
    "indexer_topk_in_blocks": indexer_topk_in_blocks,
    "indexer_topk_packed": indexer_topk_packed,
    "indexer_candidates_packed": indexer_candidates_packed,
    "indexer_topk_in_blocks_packed": indexer_topk_in_blocks_packed,
    "compress_pool": compress_pool,
    "compress_entries": compress_entries,
    "sample_tokens": sample_tokens,
    "verify_drafts": verify_drafts,
    "fp8_e4m3_fake_quant": fp8_e4m3_fake_quant,
    "fp4_e2m1_fake_quant": fp4_e2m1_fake_quant,
    "engram_hash": engram_hash,
    "engram_gate": engram_gate,
    "rms_norm_rope_fp8_e4m3_fake_quant": rms_norm_rope_fp8_e4m3_fake_quant,
    "rope_fp4_e2m1_fake_quant": rope_fp4_e2m1_fake_quant,
    "fp8_block_linear": fp8_block_linear,
    "fp8_block_grouped_linear": fp8_block_grouped_linear,
    "moe_experts_mxfp4": moe_experts_mxfp4,
    "moe_experts_fp8": moe_experts_fp8,
    "fp8_e4m3_pack": fp8_e4m3_pack,
    "fp8_e4m3_unpack": fp8_e4m3_unpack,
    "fp4_e2m1_pack": fp4_e2m1_pack,
    "fp4_e2m1_unpack": fp4_e2m1_unpack,
    "embedding_fp8": embedding_fp8,
}

#: What ``DEEPINFER_BATCH_INVARIANT=1`` replaces: kernels whose tiles are fixed for every batch size.
BATCH_INVARIANT_OVERRIDES: dict[str, Callable[..., Any]] = {
    "moe_experts": moe_experts_fixed_tiles,
    "moe_experts_mxfp4": moe_experts_mxfp4_fixed_tiles,
    "moe_experts_fp8": moe_experts_fp8_fixed_tiles,
    "fp8_block_linear": fp8_block_linear_fixed_tiles,
    "fp8_block_grouped_linear": fp8_block_grouped_linear_fixed_tiles,
}
