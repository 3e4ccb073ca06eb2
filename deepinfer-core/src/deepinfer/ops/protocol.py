"""The op table's type: one method per registered op, with exactly its reference's signature.

Core code takes ``ops: Ops`` (or an :class:`~deepinfer.ops.table.OpTable`, which mypy sees as one), so mypy checks
every op call (names, arity, argument types).  The table itself is built at run time from a backend's overrides,
which mypy cannot see through; two checks close that gap: ``tests/core/ops/test_op_protocol.py`` proves that this
protocol lists every registered op and no other, each with its reference's parameters, defaults and annotations,
and the table compares each override's signature with its reference's when it is built.

Shapes and dtypes are in each reference's docstring (the module named in each method's docstring).
"""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer.ops.fake_quant import ScaleFormat


class Ops(Protocol):
    """What models, the runner and the sampler call: ``ops.rms_norm(x, weight, eps)``.

    The bodies never run.  For mypy, :class:`~deepinfer.ops.table.OpTable` derives from this protocol (at run time
    its ops are instance attributes); a body that raises, rather than ``...``, keeps mypy from taking the methods
    for abstract ones that the table would have to define.
    """

    # --- linear algebra (deepinfer.ops.linear) ------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` (ops.linear)."""
        raise TypeError

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Block-diagonal projection (ops.linear)."""
        raise TypeError

    def embedding(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Rows of ``table`` for token ids (ops.linear)."""
        raise TypeError

    # --- norms and rotary embeddings (deepinfer.ops.norm, deepinfer.ops.rope) ----------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim (ops.norm)."""
        raise TypeError

    def rope(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
        inverse: bool = False,
    ) -> torch.Tensor:
        """Rotate the last ``2 * len(inv_freq)`` channels by position (ops.rope)."""
        raise TypeError

    def rms_norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
    ) -> torch.Tensor:
        """``rope(rms_norm(x, weight, eps), ...)`` as one op (ops.rope)."""
        raise TypeError

    # --- hyper-connections (deepinfer.ops.mhc) ------------------------------------------------------------------
    def hc_pre(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
        sinkhorn_iters: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(collapsed, post, comb) of one mHC site (ops.mhc)."""
        raise TypeError

    def hc_post(
        self, out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """New streams after a sublayer (ops.mhc)."""
        raise TypeError

    def hc_head(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
    ) -> torch.Tensor:
        """Final collapse of the streams (ops.mhc)."""
        raise TypeError

    def hc_pre_single_pass(
        self,
        streams: torch.Tensor,
        previous_pre: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
        sinkhorn_iters: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(collapsed with the previous site's pre, pre, post, comb) of a single-pass mHC site (ops.mhc)."""
        raise TypeError

    def hc_collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """``sum_k pre[k] * streams[k]`` (ops.mhc)."""
        raise TypeError

    # --- attention, indexer, compressor (deepinfer.ops.attention, .indexer, .compress) -------------------------
    def sparse_attention(
        self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attention over selected rows of a shared K=V pool (ops.attention)."""
        raise TypeError

    def sparse_attention_inverse_rope(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
    ) -> torch.Tensor:
        """``sparse_attention`` with its output's rope channels rotated back (ops.attention)."""
        raise TypeError

    def sparse_attention_packed_inverse_rope(
        self,
        q: torch.Tensor,
        rings: torch.Tensor,
        entries: torch.Tensor,
        entry_base: int,
        indices: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        ring_block: int,
        entry_block: int,
        entry_scale_format: ScaleFormat,
    ) -> torch.Tensor:
        """``sparse_attention_inverse_rope`` over packed FP8 ring rows and FP4 entry rows (ops.packed_attention)."""
        raise TypeError

    def indexer_topk_packed(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        key_pages: torch.Tensor,
        key_rows: torch.Tensor,
        key_block: int,
        key_scale_format: ScaleFormat,
        seq_ids: torch.Tensor,
        limits: torch.Tensor,
        topk: int,
        softmax_scale: float,
        weights_scale: float,
    ) -> torch.Tensor:
        """``indexer_topk`` over packed FP4 keys (ops.packed_indexer)."""
        raise TypeError

    def indexer_candidates_packed(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        key_pages: torch.Tensor,
        key_rows: torch.Tensor,
        key_block: int,
        key_scale_format: ScaleFormat,
        seq_ids: torch.Tensor,
        limits: torch.Tensor,
        topk: int,
        softmax_scale: float,
        weights_scale: float,
        block_size: int,
        topk_blocks: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``indexer_candidates`` over packed FP4 keys (ops.packed_indexer)."""
        raise TypeError

    def indexer_topk_in_blocks_packed(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        key_pages: torch.Tensor,
        key_rows: torch.Tensor,
        key_block: int,
        key_scale_format: ScaleFormat,
        seq_ids: torch.Tensor,
        limits: torch.Tensor,
        topk: int,
        softmax_scale: float,
        weights_scale: float,
        blocks: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        """``indexer_topk_in_blocks`` over packed FP4 keys (ops.packed_indexer)."""
        raise TypeError

    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        seq_ids: torch.Tensor,
        limits: torch.Tensor,
        topk: int,
        softmax_scale: float,
        weights_scale: float,
    ) -> torch.Tensor:
        """Top-``topk`` compressed entries per query (ops.indexer)."""
        raise TypeError

    def indexer_candidates(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        seq_ids: torch.Tensor,
        limits: torch.Tensor,
        topk: int,
        softmax_scale: float,
        weights_scale: float,
        block_size: int,
        topk_blocks: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidate source's top-k and its candidate blocks (ops.indexer)."""
        raise TypeError

    def indexer_topk_in_blocks(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        seq_ids: torch.Tensor,
        limits: torch.Tensor,
        topk: int,
        softmax_scale: float,
        weights_scale: float,
        blocks: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        """Top-k restricted to each query's candidate blocks (ops.indexer)."""
        raise TypeError

    def compress_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """Softmax-weighted pooling of a window's slots (ops.compress)."""
        raise TypeError

    def compress_entries(
        self,
        window: torch.Tensor,
        previous: torch.Tensor | None,
        has_previous: torch.Tensor | None,
        position_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        rope_scaling: float,
        needed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The compressor's entries of closed windows (ops.compress)."""
        raise TypeError

    # --- mixture of experts (deepinfer.ops.moe) -----------------------------------------------------------------
    def swiglu_mlp(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, swiglu_limit: float | None
    ) -> torch.Tensor:
        """Clamped SwiGLU MLP (ops.moe)."""
        raise TypeError

    def moe_experts(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        swiglu_limit: float | None,
    ) -> torch.Tensor:
        """Routed experts, weighted and summed per token (ops.moe)."""
        raise TypeError

    def moe_router(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        correction_bias: torch.Tensor | None,
        top_k: int,
        routed_scaling_factor: float,
        score_func: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) of learned routing (ops.moe)."""
        raise TypeError

    def moe_hash_router(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        ids: torch.Tensor,
        routed_scaling_factor: float,
        score_func: str,
    ) -> torch.Tensor:
        """Weights of hash routing's fixed experts (ops.moe)."""
        raise TypeError

    # --- weight dequantization (deepinfer.ops.quant) ------------------------------------------------------------
    def dequant_fp8_block(
        self, data: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """FP8 e4m3 weights with block scales (ops.quant)."""
        raise TypeError

    def dequant_mxfp4(self, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """MXFP4 weights (ops.quant)."""
        raise TypeError

    def embedding_fp8(
        self, ids: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows of an FP8 table with per-``block`` scales, dequantized as they are gathered (ops.quant)."""
        raise TypeError

    # --- GEMMs on stored weight formats (deepinfer.ops.quant_gemm) ---------------------------------------------
    def fp8_block_linear(
        self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int
    ) -> torch.Tensor:
        """``x @ W.T`` for an FP8 e4m3 weight with block scales (ops.quant_gemm)."""
        raise TypeError

    def fp8_block_grouped_linear(
        self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int
    ) -> torch.Tensor:
        """Block-diagonal projection with an FP8 e4m3 block-scaled weight (ops.quant_gemm)."""
        raise TypeError

    def moe_experts_mxfp4(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        w13: torch.Tensor,
        w13_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
        swiglu_limit: float | None,
    ) -> torch.Tensor:
        """Routed experts with MXFP4 weights, weighted and summed per token (ops.quant_gemm)."""
        raise TypeError

    def moe_experts_fp8(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        w13: torch.Tensor,
        w13_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
        block_n: int,
        block_k: int,
        swiglu_limit: float | None,
    ) -> torch.Tensor:
        """Routed experts with FP8 block-scaled weights, weighted and summed per token (ops.quant_gemm)."""
        raise TypeError

    # --- sampling and structured output (deepinfer.ops.sampling, deepinfer.ops.structured) ---------------------
    def apply_penalties(
        self,
        logits: torch.Tensor,
        prompt_mask: torch.Tensor,
        output_counts: torch.Tensor,
        presence: torch.Tensor,
        frequency: torch.Tensor,
        repetition: torch.Tensor,
    ) -> torch.Tensor:
        """Repetition, frequency and presence penalties (ops.sampling)."""
        raise TypeError

    def filter_logits(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
    ) -> torch.Tensor:
        """Temperature, min-p, top-k and top-p (ops.sampling)."""
        raise TypeError

    def sample_tokens(
        self, logits: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
    ) -> torch.Tensor:
        """One token per row (ops.sampling)."""
        raise TypeError

    def verify_drafts(
        self,
        target: torch.Tensor,
        greedy: torch.Tensor,
        draft_tokens: torch.Tensor,
        num_drafts: torch.Tensor,
        seeds: torch.Tensor,
        steps: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accept the drafts plain sampling would draw, then the request's own token (ops.speculative)."""
        raise TypeError

    def token_logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities, ranks and top alternatives (ops.sampling)."""
        raise TypeError

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Disallowed tokens' logits set to -inf (ops.structured)."""
        raise TypeError

    # --- V4.1's QAT fake-quantizers (.fake_quant, fused with rotations: .rope_quant) and Engram (.engram) -------
    def fp8_e4m3_fake_quant(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """FP8 e4m3 with a power-of-two scale per block, quantized and dequantized (ops.fake_quant)."""
        raise TypeError

    def fp4_e2m1_fake_quant(self, x: torch.Tensor, block: int, scale_format: ScaleFormat) -> torch.Tensor:
        """FP4 e2m1 with an e4m3 or ue8m0 scale per block, quantized and dequantized (ops.fake_quant)."""
        raise TypeError

    def rms_norm_rope_fp8_e4m3_fake_quant(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        block: int,
    ) -> torch.Tensor:
        """``fp8_e4m3_fake_quant(rms_norm_rope(...), block)`` as one op: V4.1's window K=V (ops.rope_quant)."""
        raise TypeError

    def rope_fp4_e2m1_fake_quant(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        block: int,
        scale_format: ScaleFormat,
    ) -> torch.Tensor:
        """``fp4_e2m1_fake_quant(rope(...), block, scale_format)`` as one op: V4.1's entries and indexer q / k
        (ops.rope_quant)."""
        raise TypeError

    def fp8_e4m3_pack(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """Rows as packed FP8 e4m3 codes and ue8m0 scale bytes (ops.kv_quant)."""
        raise TypeError

    def fp8_e4m3_unpack(self, packed: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
        """Packed FP8 rows back to values (ops.kv_quant)."""
        raise TypeError

    def fp4_e2m1_pack(self, x: torch.Tensor, block: int, scale_format: ScaleFormat) -> torch.Tensor:
        """Rows as packed FP4 e2m1 codes and e4m3 / ue8m0 scale bytes (ops.kv_quant)."""
        raise TypeError

    def fp4_e2m1_unpack(
        self, packed: torch.Tensor, block: int, scale_format: ScaleFormat, dtype: torch.dtype
    ) -> torch.Tensor:
        """Packed FP4 rows back to values (ops.kv_quant)."""
        raise TypeError

    def engram_hash(
        self, lookback: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Engram table rows of each token's n-grams (ops.engram)."""
        raise TypeError

    def engram_gate(
        self,
        streams: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """The streams plus the Engram value, gated per stream (ops.engram)."""
        raise TypeError
