"""V4.1's packed rows decoded in registers: attention's K=V rows (``sparse_attention_packed.py``) and the
indexer's keys (``indexer_topk.py``'s packed scores).

The rows a chunk of indices names live in two tensors (core's ``deepinfer/ops/packed_attention.py``): ring rows
(``idx < entry_base``) as FP8 e4m3 codes then one ue8m0 exponent byte per ``RING_BLOCK`` values, entry rows
(``idx - entry_base``) as FP4 e2m1 codes two a byte (low nibble = even channel) then one e4m3 or ue8m0 scale byte
per ``ENTRY_BLOCK``.  A row is loaded from the one tensor that holds it (masked loads: the other costs no memory
traffic) and decoded to ``code * scale`` in fp32, then the queries' dtype: every code and scale value is exact in
fp32 and the product has at most 6 significant bits, so the values are bit for bit the unpack kernels' (core's
``fp8_e4m3_unpack`` / ``fp4_e2m1_unpack``) however they are computed.  Codes and scales are loaded as the row
stores them (contiguous vector loads, each byte once) and spread over their channels in registers, rather than a
byte load per channel (a quarter of the load instructions; timings: docs/performance/log/2026-12-06.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_cuda.kernels.fp8_block_linear import _code_values
from deepinfer_cuda.kernels.kv_pack import _e2m1_value


@triton.jit
def _scaled(values, scales, N: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """values [N, D] times scales [N, D // BLOCK], each scale over its BLOCK channels (no per-channel load)."""
    scaled = tl.reshape(values, (N, D // BLOCK, BLOCK)) * scales[:, :, None]
    return tl.reshape(scaled, (N, D))


@triton.jit
def fp8_row_values(rings_ptr, idx, ring, D: tl.constexpr, RING_BLOCK: tl.constexpr, SOFT_FP8: tl.constexpr,
                   OUT: tl.constexpr):
    """Values [N, D] of packed FP8 rows ``idx`` [N] (0 where not ``ring``), in OUT: ``code * 2^(e - 127)``, exact.
    Codes and exponents are loaded as the row stores them (contiguous: vector loads)."""
    N: tl.constexpr = idx.shape[0]
    row = rings_ptr + tl.where(ring, idx, 0).to(tl.int64) * (D + D // RING_BLOCK)
    codes = tl.load(row[:, None] + tl.arange(0, D)[None, :], mask=ring[:, None], other=0)
    e = tl.load(row[:, None] + D + tl.arange(0, D // RING_BLOCK)[None, :], mask=ring[:, None], other=127)
    scales = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return _scaled(_code_values(codes, SOFT_FP8), scales, N, D, RING_BLOCK).to(OUT)


@triton.jit
def fp4_row_values(entries_ptr, rel, entry, D: tl.constexpr, ENTRY_BLOCK: tl.constexpr, ENTRY_E4M3: tl.constexpr,
                   SOFT_FP8: tl.constexpr, OUT: tl.constexpr):
    """Values [N, D] of packed FP4 rows ``rel`` [N] (0 where not ``entry``), in OUT: ``e2m1 * scale``, exact (also
    the indexer's keys: ``indexer_topk.py``).  Each byte is loaded once (vector loads) and split into its two
    nibbles, low = even channel, which are interleaved back into channel order."""
    N: tl.constexpr = rel.shape[0]
    row = entries_ptr + tl.where(entry, rel, 0).to(tl.int64) * (D // 2 + D // ENTRY_BLOCK)
    b = tl.load(row[:, None] + tl.arange(0, D // 2)[None, :], mask=entry[:, None], other=0).to(tl.int32)
    sb = tl.load(row[:, None] + D // 2 + tl.arange(0, D // ENTRY_BLOCK)[None, :], mask=entry[:, None], other=0)
    if ENTRY_E4M3:
        scales = _code_values(sb, SOFT_FP8)
    else:
        scales = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    pairs = tl.join(_scaled(_e2m1_value(b & 15), scales, N, D // 2, ENTRY_BLOCK // 2),
                    _scaled(_e2m1_value(b >> 4), scales, N, D // 2, ENTRY_BLOCK // 2))
    return tl.reshape(pairs, (N, D)).to(OUT)


@triton.jit
def load_packed_rows(rings_ptr, entries_ptr, entry_base, idx, valid, D: tl.constexpr, RING_BLOCK: tl.constexpr,
                     ENTRY_BLOCK: tl.constexpr, ENTRY_E4M3: tl.constexpr, SOFT_FP8: tl.constexpr,
                     OUT: tl.constexpr):
    """Values [BLOCK_N, D] in OUT (bf16 / fp32) of rows ``idx`` [BLOCK_N] (zeros where not ``valid``).  A chunk
    of one kind of rows (a decode step's window columns, its entry columns) decodes that kind only; a mixed chunk
    decodes its ring rows, then its entry rows over them (never both whole tiles beside a third: that selection
    cost the attention kernel twice the spills, see docs/performance/log/2026-12-06.md).  ``SOFT_FP8``:
    e4m3 codes decoded by arithmetic in fp32 (Triton's interpreter has no fp8 type), not by the hardware; the same
    values either way (every product is exact in bf16)."""
    ring = valid & (idx < entry_base)
    entry = valid & (idx >= entry_base)
    if tl.max(ring.to(tl.int32), axis=0) == 0:
        k = fp4_row_values(entries_ptr, idx - entry_base, entry, D, ENTRY_BLOCK, ENTRY_E4M3, SOFT_FP8, OUT)
    else:
        k = fp8_row_values(rings_ptr, idx, ring, D, RING_BLOCK, SOFT_FP8, OUT)  # zeros where not ring
        if tl.max(entry.to(tl.int32), axis=0) != 0:
            k = tl.where(entry[:, None], fp4_row_values(entries_ptr, idx - entry_base, entry, D, ENTRY_BLOCK,
                                                        ENTRY_E4M3, SOFT_FP8, OUT), k)
    return k
