"""V4.1's packed rows decoded in registers: attention's K=V rows (``sparse_attention_packed.py``) and the
indexer's keys (``indexer_topk.py``'s packed scores).

The rows a chunk of indices names live in two tensors (core's ``deepinfer/ops/packed_attention.py``): ring rows
(``idx < entry_base``) as FP8 e4m3 codes then one ue8m0 exponent byte per ``RING_BLOCK`` values, entry rows
(``idx - entry_base``) as FP4 e2m1 codes two a byte (low nibble = even channel) then one e4m3 or ue8m0 scale byte
per ``ENTRY_BLOCK``.  A row is loaded from the one tensor that holds it (masked loads: the other costs no memory
traffic) and decoded to ``code * scale`` in fp32, then the queries' dtype: every code and scale value is exact in
fp32 and the product has at most 6 significant bits, so the values are bit for bit the unpack kernels' (core's
``fp8_e4m3_unpack`` / ``fp4_e2m1_unpack``) however they are computed.  Each byte is loaded where its channel is
(a scale byte by all of its block's channels: L1 hits), so no tile changes layout.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_cuda.kernels.fp8_block_linear import _code_values


@triton.jit
def fp8_row_values(rings_ptr, idx, ring, dims, D: tl.constexpr, RING_BLOCK: tl.constexpr, SOFT_FP8: tl.constexpr,
                 OUT: tl.constexpr):
    """Values [N, D] of packed FP8 rows ``idx`` [N] (0 where not ``ring``), in OUT: ``code * 2^(e - 127)``, exact."""
    row = rings_ptr + tl.where(ring, idx, 0).to(tl.int64) * (D + D // RING_BLOCK)
    codes = tl.load(row[:, None] + dims[None, :], mask=ring[:, None], other=0)
    e = tl.load(row[:, None] + D + dims[None, :] // RING_BLOCK, mask=ring[:, None], other=127).to(tl.int32)
    return (_code_values(codes, SOFT_FP8) * (e << 23).to(tl.float32, bitcast=True)).to(OUT)


@triton.jit
def fp4_row_values(entries_ptr, rel, entry, dims, D: tl.constexpr, ENTRY_BLOCK: tl.constexpr,
                  ENTRY_E4M3: tl.constexpr, SOFT_FP8: tl.constexpr, OUT: tl.constexpr):
    """Values [N, D] of packed FP4 rows ``rel`` [N] (0 where not ``entry``), in OUT: ``e2m1 * scale``, exact (also
    the indexer's keys: ``indexer_topk.py``).  An e2m1 code
    ``s e1 e0 m`` is built as fp32 bits: ``(e + 126, m)`` when e > 0, 0.5 or 0 when e = 0, signed (``-0`` kept)."""
    row = entries_ptr + tl.where(entry, rel, 0).to(tl.int64) * (D // 2 + D // ENTRY_BLOCK)
    b = tl.load(row[:, None] + dims[None, :] // 2, mask=entry[:, None], other=0).to(tl.int32)
    sb = tl.load(row[:, None] + D // 2 + dims[None, :] // ENTRY_BLOCK, mask=entry[:, None], other=0)
    if ENTRY_E4M3:
        scale = _code_values(sb, SOFT_FP8)
    else:
        scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    c = (b >> ((dims[None, :] & 1) * 4)) & 15
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22)) | ((c & 8) << 28)
    return (bits.to(tl.float32, bitcast=True) * scale).to(OUT)


@triton.jit
def load_packed_rows(rings_ptr, entries_ptr, entry_base, idx, valid, D: tl.constexpr, RING_BLOCK: tl.constexpr,
                     ENTRY_BLOCK: tl.constexpr, ENTRY_E4M3: tl.constexpr, SOFT_FP8: tl.constexpr,
                     OUT: tl.constexpr):
    """Values [BLOCK_N, D] in OUT (bf16 / fp32) of rows ``idx`` [BLOCK_N] (zeros where not ``valid``).  A chunk
    of one kind of rows (a decode step's window columns, its entry columns) decodes that kind only.  ``SOFT_FP8``:
    e4m3 codes decoded by arithmetic in fp32 (Triton's interpreter has no fp8 type), not by the hardware; the same
    values either way (every product is exact in bf16)."""
    dims = tl.arange(0, D)
    ring = valid & (idx < entry_base)
    entry = valid & (idx >= entry_base)
    if tl.max(entry.to(tl.int32), axis=0) == 0:
        k = fp8_row_values(rings_ptr, idx, ring, dims, D, RING_BLOCK, SOFT_FP8, OUT)
    elif tl.max(ring.to(tl.int32), axis=0) == 0:
        k = fp4_row_values(entries_ptr, idx - entry_base, entry, dims, D, ENTRY_BLOCK, ENTRY_E4M3, SOFT_FP8, OUT)
    else:
        k = tl.where(ring[:, None], fp8_row_values(rings_ptr, idx, ring, dims, D, RING_BLOCK, SOFT_FP8, OUT),
                     fp4_row_values(entries_ptr, idx - entry_base, entry, dims, D, ENTRY_BLOCK, ENTRY_E4M3, SOFT_FP8,
                                   OUT))
    return k
