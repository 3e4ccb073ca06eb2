"""Sparse attention with sinks over a shared K=V pool: split-K over fixed column splits, tensor-core products.

Overrides core's ``sparse_attention(q, kv, indices, sinks, scale)`` (deepinfer/ops/attention.py).  The reference
gathers every query's keys into a [T, K, D] fp32 tensor and multiplies without tensor cores.  Here the index
columns are cut into fixed splits of SPLIT_N (from arch.py: the architecture and head_dim, never the batch), and
each split's softmax state is computed from scratch (V4 has one KV head: a block of heads shares each gathered row):

    per split s:  m_s, l_s, acc_s = -inf, 0, 0
        for each chunk of BLOCK_N columns:    k = kv[idx] gathered once for BLOCK_H heads (-1 -> masked)
            s = (q @ k^T) * scale             tensor cores (bf16 in, fp32 accumulate)
            m' = max(m_s, max s); p = exp(s - m'); l_s = l_s e^(m_s - m') + sum p; acc_s = acc_s e^(m_s - m') + p @ k
    M, L, ACC = sink, 1, 0                    the sink joins the denominator and adds no value, exactly once
    for s in order:  M' = max(M, m_s); L = L e^(M - M') + l_s e^(m_s - M'); ACC likewise  (skipped if m_s = -inf)
    out = ACC / L

Two regimes, chosen per call for speed only:
- *split* (few queries: decode): one program per (query, head block, split) writes (m_s, l_s, acc_s) to an fp32
  workspace; ``_combine_kernel`` (one program per query and head) merges the splits in order.
- *whole* (many queries: large decode batches, prefill): one program per (query, head block) computes the same
  splits one after another and merges each into registers as it goes (no workspace traffic).
One flat loop over chunks (the split's end is a branch inside it) keeps the gather pipeline running across splits.
Both run the same attention binary (``partial`` is a runtime flag), the same split arithmetic and the same merge
(``_merge``, with explicit fmas so no compiler contraction can differ between the two kernels), so they give the
same bits: a row's result depends neither on the regime nor on the other rows.  Width padding (-1) only adds
masked chunks (p = 0, rescale exactly 1) or whole splits with m_s = -inf, which the merge skips.  A query with no
valid index returns zeros (M = sink, L = 1, ACC = 0).  fp32 inputs use IEEE fp32 products (not TF32).
With ``skip_empty`` a program first scans its index columns and walks only the chunks from the first to the last
valid one (prefill rows are -1 at both ends): the chunks it leaves out would not have changed a bit, and a live
stretch that ends inside a split is merged where it ends, as the split's remaining -1 chunks would have left it.
``transposed`` tiles compute s^T = k @ q^T and acc^T = k^T @ p^T: the gathered rows are then the M side of both
products, so a 64-row chunk is a Hopper wgmma (32 heads as M is an mma.sync); other bits, the same in both regimes.
``PACKED`` (``sparse_attention_packed.py``): the pool is V4.1's packed FP8 ring rows and FP4 entry rows, decoded in
registers as each chunk is gathered (``packed_rows.py``); the rest of the kernel is the same code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer_cuda import coverage
from deepinfer_cuda.arch import CudaArch, SparseAttentionTiles, sparse_attention_config
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.kernels.packed_rows import load_packed_rows
from deepinfer_cuda.kernels.rope import rope_pairs
from deepinfer_cuda.override import override

#: (heads, head_dim) compiled ahead of time: V4-Flash / V4.1-Flash 64 x 512, and 128 x 512 (V4-Pro width).
AOT_SHAPES = ((64, 512), (128, 512))
#: Rope pairs rotated back in the epilogue: 0 (plain ``sparse_attention``) and V4's 64 rope channels.
AOT_ROPE_HALVES = (0, 32)
#: Work around Triton's CPU interpreter, which computes bf16 ``tl.dot`` wrongly: multiply in fp32 (bf16 products
#: are exact in fp32).  Off on the GPU, turned on by the interpreter test.
INTERPRETED = False


@triton.jit
def _merge(M, L, ACC, m_s, l_s, acc_s, TRANS: tl.constexpr = False):
    """Fold one split's state into the running (M, L, ACC); a split with no valid column (m_s = -inf) leaves it
    untouched, bit for bit.  The one merge both kernels use (``TRANS``: ACC is [D, heads], the same element ops)."""
    has = m_s > float("-inf")
    m_new = tl.maximum(M, m_s)
    a = tl.exp(M - m_new)
    b = tl.exp(m_s - m_new)
    l_new = tl.fma(l_s, b, L * a)
    if TRANS:
        acc_new = tl.fma(acc_s, b[None, :], ACC * a[None, :])
        acc_out = tl.where(has[None, :], acc_new, ACC)
    else:
        acc_new = tl.fma(acc_s, b[:, None], ACC * a[:, None])
        acc_out = tl.where(has[:, None], acc_new, ACC)
    return tl.where(has, m_new, M), tl.where(has, l_new, L), acc_out


@triton.jit
def _rotate_back(out_ptr, t, heads, head_ok, pos_ptr, inv_freq_ptr, rope_scaling, H: tl.constexpr, D: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate the rope channels of the program's stored output rows back by the query's position (V4's values
    carry the keys' rotation): the rope kernel's inverse arithmetic on the stored values, so the bits are
    ``rope(out, inverse=True)``'s.  The barrier makes every thread's stores of the tile visible to the loads."""
    tl.debug_barrier()
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + tl.arange(0, HALF))
    cos = libdevice.cos(angle) * rope_scaling
    sin = -(libdevice.sin(angle) * rope_scaling)
    rot_cols = D - 2 * HALF + tl.arange(0, 2 * HALF)
    ptrs = out_ptr + t * (H * D) + heads[:, None].to(tl.int64) * D + rot_cols[None, :]
    x = tl.load(ptrs, mask=head_ok[:, None], other=0.0)
    even, odd = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_H, HALF, 2)))
    out_even = even * cos[None, :] - odd * sin[None, :]
    out_odd = odd * cos[None, :] + even * sin[None, :]
    y = tl.reshape(tl.interleave(out_even, out_odd), (BLOCK_H, 2 * HALF))
    tl.store(ptrs, y.to(x.dtype), mask=head_ok[:, None])


@triton.jit
def _live_chunks(idx_row, col_lo, col_hi, BLOCK_N: tl.constexpr, SCAN: tl.constexpr):
    """Chunks [lo, hi) of BLOCK_N columns spanning the valid indices among columns [col_lo, col_hi) of a row
    (lo = hi when there is none).  Chunks outside hold -1 only: walking them would leave the softmax state bit for
    bit as it is (p = 0, rescale exactly 1), so skipping them is free of any numerical effect."""
    first = col_hi
    last = col_lo - 1
    for w in range(col_lo, col_hi, SCAN):
        cols = w + tl.arange(0, SCAN)
        valid = tl.load(idx_row + cols, mask=cols < col_hi, other=-1) >= 0
        first = tl.minimum(first, tl.min(tl.where(valid, cols, col_hi), axis=0))
        last = tl.maximum(last, tl.max(tl.where(valid, cols, col_lo - 1), axis=0))
    lo = first // BLOCK_N
    return lo, tl.maximum(lo, (last + BLOCK_N) // BLOCK_N)  # last + BLOCK_N >= 0: no negative division


@triton.jit(do_not_specialize=["width", "n_splits", "partial", "entry_base"])
def _sparse_attention_kernel(q_ptr, kv_ptr, entries_ptr, idx_ptr, sinks_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr, pos_ptr,
                             inv_freq_ptr, width, n_splits, partial, entry_base, scale, rope_scaling,
                             H: tl.constexpr, D: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr,
                             SKIP_EMPTY: tl.constexpr, TRANS: tl.constexpr, ROPE_HALF: tl.constexpr,
                             PACKED: tl.constexpr, RING_BLOCK: tl.constexpr, ENTRY_BLOCK: tl.constexpr,
                             ENTRY_E4M3: tl.constexpr, SOFT_FP8: tl.constexpr):
    wait_for_producers()
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    z = tl.program_id(2)
    head_ok = heads < H
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    if TRANS:  # [BLOCK_D, BLOCK_H] tiles: the gathered rows are the M side of both products (wgmma needs M >= 64)
        q_offs = t * (H * D) + heads[None, :] * D + dims[:, None]
        q_mask = head_ok[None, :] & dim_ok[:, None]
        ACC = tl.zeros([BLOCK_D, BLOCK_H], dtype=tl.float32)
        acc_s = tl.zeros([BLOCK_D, BLOCK_H], dtype=tl.float32)
    else:
        q_offs = t * (H * D) + heads[:, None] * D + dims[None, :]
        q_mask = head_ok[:, None] & dim_ok[None, :]
        ACC = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        acc_s = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    M = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)  # the sink: exp(sink - M) = 1
    L = tl.full([BLOCK_H], 1.0, tl.float32)
    # partial: this program's split z only; whole (grid z = 1): every split of the row, in order.
    CHUNKS: tl.constexpr = SPLIT_N // BLOCK_N
    c_lo = z * CHUNKS
    c_hi = (z + 1 + (1 - partial) * (n_splits - 1)) * CHUNKS
    if SKIP_EMPTY:  # walk only the chunks from the first to the last valid index of those columns
        c_lo, c_hi = _live_chunks(idx_ptr + t * width, c_lo * BLOCK_N, tl.minimum(c_hi * BLOCK_N, width),
                                  BLOCK_N, SPLIT_N)
    m_s = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_s = tl.zeros([BLOCK_H], dtype=tl.float32)
    for c in range(c_lo, c_hi):
        cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t * width + cols, mask=cols < width, other=-1)
        valid = idx >= 0
        if PACKED:  # kv_ptr: the ring rows (FP8), entries_ptr: the entry rows (FP4); D = BLOCK_D
            k = load_packed_rows(kv_ptr, entries_ptr, entry_base, idx, valid, D, RING_BLOCK, ENTRY_BLOCK, ENTRY_E4M3,
                                 SOFT_FP8, q_ptr.dtype.element_ty)
        else:
            k = tl.load(kv_ptr + tl.maximum(idx, 0).to(tl.int64)[:, None] * D + dims[None, :],
                        mask=valid[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D], K = V
        if FP32_DOT:
            k = k.to(tl.float32)
        if TRANS:
            if FP32_DOT:
                s = tl.dot(k, q, input_precision="ieee")
            else:
                s = tl.dot(k, q)  # [BLOCK_N, BLOCK_H]
            s = tl.where(valid[:, None], s * scale, float("-inf"))
            m_new = tl.maximum(m_s, tl.max(s, axis=0))
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # all masked so far: p = 0, state stays 0
            alpha = tl.exp(m_s - m_use)
            p = tl.exp(s - m_use[None, :])
            l_s = l_s * alpha + tl.sum(p, axis=0)
            if FP32_DOT:
                acc_s = tl.dot(tl.trans(k), p, acc_s * alpha[None, :], input_precision="ieee")
            else:
                acc_s = tl.dot(tl.trans(k), p.to(k.dtype), acc_s * alpha[None, :])
        else:
            if FP32_DOT:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_s, tl.max(s, axis=1))
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # all masked so far: p = 0, state stays 0
            alpha = tl.exp(m_s - m_use)
            p = tl.exp(s - m_use[:, None])
            l_s = l_s * alpha + tl.sum(p, axis=1)
            if FP32_DOT:
                acc_s = tl.dot(p, k, acc_s * alpha[:, None], input_precision="ieee")
            else:
                acc_s = tl.dot(p.to(k.dtype), k, acc_s * alpha[:, None])
        m_s = m_new
        # A split ends (or the live chunks do: the rest of the split is -1, which would change nothing): merge its
        # state and start the next from scratch.  The split regime publishes its one split after the loop.
        if (partial == 0) & (((c + 1) % CHUNKS == 0) | (c == c_hi - 1)):
            M, L, ACC = _merge(M, L, ACC, m_s, l_s, acc_s, TRANS)
            m_s = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l_s = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc_s = tl.zeros_like(acc_s)
    if partial != 0:  # workspace [T, n_splits, 2, H] (m, l) and [T, n_splits, H, D] (acc); -inf, 0, 0 if no column
        row = t * n_splits + z
        tl.store(ws_ml_ptr + row * (2 * H) + heads, m_s, mask=head_ok)
        tl.store(ws_ml_ptr + row * (2 * H) + H + heads, l_s, mask=head_ok)
        tl.store(ws_acc_ptr + row * (H * D) + (q_offs - t * (H * D)), acc_s, mask=q_mask)
    if partial == 0:
        if TRANS:
            out = ACC / L[None, :]
        else:
            out = ACC / L[:, None]
        tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
        if ROPE_HALF > 0:
            _rotate_back(out_ptr, t, heads, head_ok, pos_ptr, inv_freq_ptr, rope_scaling, H, D, ROPE_HALF, BLOCK_H)


@triton.jit(do_not_specialize=["n_splits"])
def _combine_kernel(ws_acc_ptr, ws_ml_ptr, sinks_ptr, out_ptr, pos_ptr, inv_freq_ptr, n_splits, rope_scaling,
                    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ROPE_HALF: tl.constexpr):
    """One program per (query, head): the sink, then every split in order, then ACC / L (then the inverse
    rotation, with ``ROPE_HALF``)."""
    wait_for_producers()
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) + tl.arange(0, 1)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    M = tl.load(sinks_ptr + heads).to(tl.float32)
    L = tl.full([1], 1.0, tl.float32)
    ACC = tl.zeros([1, BLOCK_D], dtype=tl.float32)
    for sp in range(0, n_splits):
        row = t * n_splits + sp
        m_s = tl.load(ws_ml_ptr + row * (2 * H) + heads)
        l_s = tl.load(ws_ml_ptr + row * (2 * H) + H + heads)
        acc_s = tl.load(ws_acc_ptr + row * (H * D) + heads[:, None] * D + dims[None, :], mask=dim_ok[None, :],
                        other=0.0)
        M, L, ACC = _merge(M, L, ACC, m_s, l_s, acc_s)
    out = ACC / L[:, None]
    tl.store(out_ptr + t * (H * D) + heads[:, None] * D + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=dim_ok[None, :])
    if ROPE_HALF > 0:
        _rotate_back(out_ptr, t, heads, heads < H, pos_ptr, inv_freq_ptr, rope_scaling, H, D, ROPE_HALF, 1)


def _block_d(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


#: The constexprs of the plain (bf16 / fp32 pool) kernel's packed-row decoding: off.
PLAIN_POOL: dict[str, object] = {"PACKED": False, "RING_BLOCK": 32, "ENTRY_BLOCK": 16, "ENTRY_E4M3": True,
                                 "SOFT_FP8": False}


def _constexprs(heads: int, dim: int, tiles: SparseAttentionTiles, fp32: bool, rope_half: int,
                pool: dict[str, object] | None = None) -> dict[str, object]:
    return {"H": heads, "D": dim, "FP32_DOT": fp32 or INTERPRETED, "BLOCK_H": tiles.block_h,
            "BLOCK_D": _block_d(dim), "BLOCK_N": tiles.block_n, "SPLIT_N": tiles.split_n,
            "SKIP_EMPTY": tiles.skip_empty, "TRANS": tiles.transposed, "ROPE_HALF": rope_half,
            **(pool or PLAIN_POOL)}


def _rope_signature(rope_half: int) -> tuple[dict[str, str], dict[str, object]]:
    """The rope pointers' signature entries, or (without the rotation) the None constexprs they fold to."""
    if rope_half:
        return {"pos_ptr": "*i64:D", "inv_freq_ptr": "*fp32:D"}, {}
    return {}, {"pos_ptr": None, "inv_freq_ptr": None}


def attention_variants(arch: CudaArch, shapes: tuple[tuple[int, int], ...], rope_halves: tuple[int, ...],
                       pool_sig: dict[str, str], pool_const: dict[str, object]) -> list[Variant]:
    """Contiguous bf16 queries, int64 indices, fp32 sinks and workspace at ``shapes`` (heads, head_dim); the pool's
    pointers as ``pool_sig`` (and None constexprs) and its decoding constexprs ``pool_const``."""
    variants = []
    for heads, dim in shapes:
        tiles = sparse_attention_config(arch, heads, dim, 2)
        for rope_half in rope_halves:
            rope_sig, rope_const = _rope_signature(rope_half)
            sig = {"q_ptr": "*bf16:D", **pool_sig, "idx_ptr": "*i64:D", "sinks_ptr": "*fp32:D",
                   "out_ptr": "*bf16:D", "ws_acc_ptr": "*fp32:D", "ws_ml_ptr": "*fp32:D", **rope_sig,
                   "width": "i32", "n_splits": "i32", "partial": "i32", "entry_base": "i32", "scale": "fp32",
                   "rope_scaling": "fp32"}
            const = {**_constexprs(heads, dim, tiles, False, rope_half, pool_const), **rope_const}
            if "entries_ptr" not in pool_sig:
                const["entries_ptr"] = None
            variants.append(Variant(sig, const, tiles.split.num_warps, tiles.split.num_stages))
    return variants


def _aot_variants(arch: CudaArch) -> list[Variant]:
    """A bf16 pool."""
    return attention_variants(arch, AOT_SHAPES, AOT_ROPE_HALVES, {"kv_ptr": "*bf16:D"}, PLAIN_POOL)


def _combine_aot_variants(arch: CudaArch) -> list[Variant]:
    variants = []
    for heads, dim in AOT_SHAPES:
        tiles = sparse_attention_config(arch, heads, dim, 2)
        for rope_half in AOT_ROPE_HALVES:
            rope_sig, rope_const = _rope_signature(rope_half)
            sig = {"ws_acc_ptr": "*fp32:D", "ws_ml_ptr": "*fp32:D", "sinks_ptr": "*fp32:D", "out_ptr": "*bf16:D",
                   **rope_sig, "n_splits": "i32", "rope_scaling": "fp32"}
            const = {"H": heads, "D": dim, "BLOCK_D": _block_d(dim), "ROPE_HALF": rope_half, **rope_const}
            variants.append(Variant(sig, const, tiles.combine.num_warps, tiles.combine.num_stages))
    return variants


KERNEL = TritonKernel("sparse_attention", _sparse_attention_kernel, _aot_variants)
COMBINE_KERNEL = TritonKernel("sparse_attention_combine", _combine_kernel, _combine_aot_variants)


def plan_attention(q: torch.Tensor, pool: dict[str, object], pool_const: dict[str, object], indices: torch.Tensor,
                   sinks: torch.Tensor, scale: float, positions: torch.Tensor | None, inv_freq: torch.Tensor | None,
                   rope_scaling: float, *, arch: CudaArch, split: bool | None, tiles: SparseAttentionTiles | None,
                   kernel: TritonKernel, fp32_dot: bool = False) -> LaunchChain:
    """The attention kernel's launch (``kernel``: which op's cubins) over a pool given as its pointer arguments
    ``pool`` (``kv_ptr``, ``entries_ptr``, ``entry_base``) and decoding constexprs, then the split combine."""
    tokens, heads, dim = q.shape
    indices = indices.to(torch.int64).contiguous()
    sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    rope_half = 0
    if inv_freq is not None:
        if positions is None:
            raise ValueError("sparse_attention_inverse_rope: inv_freq needs the queries' positions")
        rope_half = rope_pairs("sparse_attention_inverse_rope", inv_freq, dim)
        positions = positions.to(device=q.device, dtype=torch.int64).contiguous()
        inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    out = torch.empty_like(q)
    tiles = tiles or sparse_attention_config(arch, heads, dim, q.element_size())
    if tiles.split_n % tiles.block_n:
        raise ValueError(f"split_n {tiles.split_n} is not a multiple of block_n {tiles.block_n}")
    width = indices.shape[1]
    n_splits = triton.cdiv(width, tiles.split_n)
    head_blocks = triton.cdiv(heads, tiles.block_h)
    if split is None:
        split = tokens * head_blocks <= tiles.split_below
    split = split and n_splits > 1
    ws_rows = tokens * n_splits if split else 1
    ws_acc = torch.empty(ws_rows * heads * dim if split else 1, device=q.device, dtype=torch.float32)
    ws_ml = torch.empty(ws_rows * 2 * heads, device=q.device, dtype=torch.float32)
    rope = dict(pos_ptr=positions if rope_half else None, inv_freq_ptr=inv_freq if rope_half else None,
                rope_scaling=float(rope_scaling))
    args = dict(q_ptr=q, **pool, idx_ptr=indices, sinks_ptr=sinks, out_ptr=out, ws_acc_ptr=ws_acc,
                ws_ml_ptr=ws_ml, width=width, n_splits=n_splits, partial=int(split), scale=float(scale), **rope,
                **_constexprs(heads, dim, tiles, q.dtype == torch.float32 or fp32_dot, rope_half, pool_const))
    steps = [(kernel, Launch((tokens, head_blocks, n_splits if split else 1), tiles.split, args, out))]
    if split:
        combine = dict(ws_acc_ptr=ws_acc, ws_ml_ptr=ws_ml, sinks_ptr=sinks, out_ptr=out, n_splits=n_splits, H=heads,
                       D=dim, BLOCK_D=_block_d(dim), ROPE_HALF=rope_half, **rope)
        steps.append((COMBINE_KERNEL, Launch((tokens, heads), tiles.combine, combine, out)))
    return LaunchChain(steps, lambda: out)


def prepare(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float,
            positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None, rope_scaling: float = 1.0, *,
            arch: CudaArch, split: bool | None = None,
            tiles: SparseAttentionTiles | None = None) -> LaunchChain:
    """Plan ``sparse_attention(q, kv, indices, sinks, scale)`` for ``arch``: outputs allocated, nothing launched;
    with ``positions`` and ``inv_freq``, ``sparse_attention_inverse_rope`` (the rotation in the epilogue).

    ``split`` forces a regime (tests); by default split-K runs when queries x head blocks leave most SMs idle.
    Either regime gives the same bits.  ``tiles`` overrides arch.py's (tools/sweep/sparse_attention.py)."""
    q = q.contiguous()
    pool: dict[str, object] = dict(kv_ptr=kv.to(q.dtype).contiguous(), entries_ptr=None, entry_base=0)
    return plan_attention(q, pool, PLAIN_POOL, indices, sinks, scale, positions, inv_freq, rope_scaling, arch=arch,
                          split=split, tiles=tiles, kernel=KERNEL)


# batch-invariant: one program per query, fixed key chunks; checked on an H200
@override("sparse_attention", batch_invariant=True, aot=(KERNEL, COMBINE_KERNEL))
def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [T, H, D] attends to rows ``indices`` [T, K] (-1 = none) of the K=V pool kv [P, D], sinks [H]; [T, H, D]."""
    index, arch = cuda_target(q)
    return prepare(q, kv, indices, sinks, scale, arch=arch).run(index)


def inverse_rope_covers(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float,
                        positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> bool:
    """The rotation epilogue takes the rope channels as one tile."""
    return coverage.rope_fits(inv_freq, q.shape[-1])


# batch-invariant: sparse_attention's kernel, the rotation its epilogue; checked on an H200
@override("sparse_attention_inverse_rope", coverage=inverse_rope_covers, batch_invariant=True,
          aot=(KERNEL, COMBINE_KERNEL))
def sparse_attention_inverse_rope(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float,
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
) -> torch.Tensor:
    """:func:`sparse_attention`, its output's rope channels rotated back at each query's position in the epilogue
    (no second pass over [T, H, D])."""
    index, arch = cuda_target(q)
    return prepare(q, kv, indices, sinks, scale, positions, inv_freq, attention_scaling, arch=arch).run(index)
