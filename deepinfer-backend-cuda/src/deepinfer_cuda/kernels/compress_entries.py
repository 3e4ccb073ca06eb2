"""The compressor's KV entry of a window as one Triton pass: gated pooling, RMSNorm and partial RoPE.

Overrides core's ``compress_entries(window, previous, has_previous, position_bias, norm_weight, eps, positions,
inv_freq, rope_scaling)`` (deepinfer/ops/compress.py), which the model ran as ~8 kernels (score add, the CSA
predecessor's add / where / two cats, compress_pool, rms_norm, rope).  One program per window:

1. pooling, per ``[slots, block_c]`` tile as ``kernels/compress_pool.py`` does it: slot scores (gate + position
   bias, fp32; CSA's first r slots from the predecessor's series a, ``-inf`` where it has none), softmax in fp32,
   weights and products rounded to the model dtype, fp32 sum rounded once.  A row that fits one tile (CSA, the
   indexer) stays in registers; wider ones (HCA: 128 slots) go tile by tile through the output row, which the
   program reads back after a barrier;
2. RMSNorm of the rounded row in fp32 with the weight, rounded to the model dtype (as ``rms_norm``);
3. RoPE of the trailing ``2 * len(inv_freq)`` channels in fp32 (interleaved pairs, as ``kernels/rope.py``),
   rounded and stored.

A program reads only its own window, so results do not depend on the batch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer_cuda import coverage
from deepinfer_cuda.arch import CudaArch, LaunchConfig, compress_entries_config
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.compress_pool import _rounded
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.override import override

#: (ratio, dim, overlap) compiled ahead of time: V4's CSA (ratio 4, series a | b) at head dim 512, its indexer's
#: compressor at 128, HCA (ratio 128); rope dim 64 throughout.
AOT_SHAPES = ((4, 512, True), (4, 128, True), (128, 512, False))
AOT_ROPE_DIM = 64
AOT_DTYPES = ("bf16", "fp32")
#: Triton's CPU interpreter truncates fp32 -> bf16 casts; the interpreter test turns this on to round to nearest
#: even by hand (see compress_pool).  Off on the GPU.
INTERPRETED = False


@triton.jit
def _pooled(window_ptr, previous_ptr, has_prev_ptr, bias_ptr, win, cols, R: tl.constexpr, DIM: tl.constexpr,
            OVERLAP: tl.constexpr, MASKED: tl.constexpr, BLOCK_S: tl.constexpr, dtype: tl.constexpr,
            INTERPRETED: tl.constexpr):
    """Pooled channels ``cols`` of window ``win`` (fp32 holding values rounded to ``dtype``)."""
    slots = tl.arange(0, BLOCK_S)
    col_ok = (cols < DIM)[None, :]
    if OVERLAP:  # slots 0..r-1: the predecessor's series a; r..2r-1: this window's series b
        own = slots >= R
        row = tl.where(own, slots - R, slots)  # the token of its window
        own_m = (own & (slots < 2 * R))[:, None] & col_ok
        prev_m = (slots < R)[:, None] & col_ok
        w_offs = win * (R * 4 * DIM) + row[:, None] * (4 * DIM) + DIM + cols[None, :]  # kv b; gate b at + 2 * DIM
        p_offs = win * (R * 2 * DIM) + row[:, None] * (2 * DIM) + cols[None, :]  # kv a; gate a at + DIM
        kv = tl.where(own[:, None], tl.load(window_ptr + w_offs, mask=own_m, other=0.0),
                      tl.load(previous_ptr + p_offs, mask=prev_m, other=0.0)).to(tl.float32)
        gate = tl.where(own[:, None], tl.load(window_ptr + w_offs + 2 * DIM, mask=own_m, other=0.0),
                        tl.load(previous_ptr + p_offs + DIM, mask=prev_m, other=0.0)).to(tl.float32)
        b_offs = row[:, None] * (2 * DIM) + tl.where(own, DIM, 0)[:, None] + cols[None, :]
        score = gate + tl.load(bias_ptr + b_offs, mask=own_m | prev_m, other=0.0)
        slot_ok = slots < 2 * R
        if MASKED:  # no predecessor: its slots weigh 0
            slot_ok = slot_ok & ((tl.load(has_prev_ptr + win) != 0) | own)
    else:
        mask = (slots < R)[:, None] & col_ok
        offs = win * (R * 2 * DIM) + slots[:, None] * (2 * DIM) + cols[None, :]
        kv = tl.load(window_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(window_ptr + offs + DIM, mask=mask, other=0.0).to(tl.float32)
        score = gate + tl.load(bias_ptr + slots[:, None] * DIM + cols[None, :], mask=mask, other=0.0)
        slot_ok = slots < R
    score = tl.where(slot_ok[:, None], score, float("-inf"))
    e = tl.exp(score - tl.max(score, axis=0)[None, :])  # an empty slot (-inf) weighs exactly 0
    weight = _rounded(e / tl.sum(e, axis=0)[None, :], dtype, INTERPRETED)
    return _rounded(tl.sum(_rounded(kv * weight, dtype, INTERPRETED), axis=0), dtype, INTERPRETED)


@triton.jit
def _entry(window_ptr, previous_ptr, has_prev_ptr, bias_ptr, weight_ptr, pos_ptr, inv_freq_ptr, out_ptr, eps, scaling,
           win, R: tl.constexpr, DIM: tl.constexpr, OVERLAP: tl.constexpr, MASKED: tl.constexpr, HALF: tl.constexpr,
           BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    """Window ``win``'s entry, stored to its row of ``out``."""
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)
    row_ptr = out_ptr + win * DIM
    # 1. Gated pooling, rounded to the model dtype.
    if BLOCK_C >= DIM:
        x = _pooled(window_ptr, previous_ptr, has_prev_ptr, bias_ptr, win, cols, R, DIM, OVERLAP, MASKED, BLOCK_S,
                    dtype, INTERPRETED)
    else:  # tile by tile through the output row
        for start in range(0, DIM, BLOCK_C):
            block = start + tl.arange(0, BLOCK_C)
            pooled = _pooled(window_ptr, previous_ptr, has_prev_ptr, bias_ptr, win, block, R, DIM, OVERLAP, MASKED,
                             BLOCK_S, dtype, INTERPRETED)
            tl.store(row_ptr + block, pooled.to(dtype), mask=block < DIM)
        tl.debug_barrier()  # the row's tiles, stored by all threads, visible to all
        x = tl.load(row_ptr + cols, mask=cols < DIM, other=0.0).to(tl.float32)
    # 2. RMSNorm in fp32, rounded to the model dtype.
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / DIM + eps)
    w = tl.load(weight_ptr + cols, mask=cols < DIM, other=0.0).to(tl.float32)
    y = _rounded(x * inv_rms * w, dtype, INTERPRETED)
    # 3. RoPE: the pairs (y[2i], y[2i+1]) of the trailing HALF pairs rotate by position * inv_freq; the rest pass.
    even, odd = tl.split(tl.reshape(y, (BLOCK_D // 2, 2)))
    pairs = tl.arange(0, BLOCK_D // 2)
    rot = (pairs >= DIM // 2 - HALF) & (pairs < DIM // 2)
    freq = tl.load(inv_freq_ptr + (pairs - (DIM // 2 - HALF)), mask=rot, other=0.0)
    angle = tl.load(pos_ptr + win).to(tl.float32) * freq
    cos = libdevice.cos(angle) * scaling
    sin = libdevice.sin(angle) * scaling
    out_even = tl.where(rot, even * cos - odd * sin, even)
    out_odd = tl.where(rot, odd * cos + even * sin, odd)
    entry = tl.reshape(tl.interleave(out_even, out_odd), (BLOCK_D,))
    if BLOCK_C < DIM:
        tl.debug_barrier()  # every thread has read the pooled row before it is overwritten
    tl.store(row_ptr + cols, _rounded(entry, dtype, INTERPRETED).to(dtype), mask=cols < DIM)


@triton.jit
def _compress_entries_kernel(window_ptr, previous_ptr, has_prev_ptr, needed_ptr, bias_ptr, weight_ptr, pos_ptr,
                             inv_freq_ptr, out_ptr, eps, scaling, R: tl.constexpr, DIM: tl.constexpr,
                             OVERLAP: tl.constexpr, MASKED: tl.constexpr, HAS_NEEDED: tl.constexpr, HALF: tl.constexpr,
                             BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                             INTERPRETED: tl.constexpr):
    wait_for_producers()
    win = tl.program_id(0).to(tl.int64)
    if HAS_NEEDED:  # a window no one reads (decode: it does not close at this token) is stored as zeros, unread
        if tl.load(needed_ptr + win) != 0:
            _entry(window_ptr, previous_ptr, has_prev_ptr, bias_ptr, weight_ptr, pos_ptr, inv_freq_ptr, out_ptr, eps,
                   scaling, win, R, DIM, OVERLAP, MASKED, HALF, BLOCK_S, BLOCK_C, BLOCK_D, INTERPRETED)
        else:
            cols = tl.arange(0, BLOCK_D)
            tl.store(out_ptr + win * DIM + cols, tl.zeros([BLOCK_D], out_ptr.dtype.element_ty), mask=cols < DIM)
    else:
        _entry(window_ptr, previous_ptr, has_prev_ptr, bias_ptr, weight_ptr, pos_ptr, inv_freq_ptr, out_ptr, eps,
               scaling, win, R, DIM, OVERLAP, MASKED, HALF, BLOCK_S, BLOCK_C, BLOCK_D, INTERPRETED)


@functools.cache
def _plan(arch: CudaArch, ratio: int, dim: int, overlap: bool, masked: bool, has_needed: bool,
          rope_dim: int) -> tuple[LaunchConfig, dict[str, object]]:
    slots = 2 * ratio if overlap else ratio
    cfg, block_c = compress_entries_config(arch, slots, dim)
    return cfg, {"R": ratio, "DIM": dim, "OVERLAP": overlap, "MASKED": masked, "HAS_NEEDED": has_needed,
                 "HALF": rope_dim // 2,
                 "BLOCK_S": max(2, triton.next_power_of_2(slots)), "BLOCK_C": block_c,
                 "BLOCK_D": max(16, triton.next_power_of_2(dim)), "INTERPRETED": INTERPRETED}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    """Contiguous bf16 / fp32 windows, fp32 bias, norm weight and inv_freq, int64 positions; CSA with and without a
    mask of missing predecessors; with a mask of the windows needed (decode: those closing) and without (prefill)."""
    variants = []
    for ratio, dim, overlap in AOT_SHAPES:
        for masked in ((False, True) if overlap else (False,)):
            for has_needed in (False, True):
                cfg, const = _plan(arch, ratio, dim, overlap, masked, has_needed, AOT_ROPE_DIM)
                for dtype in AOT_DTYPES:
                    sig = {"window_ptr": f"*{dtype}:D"}
                    if overlap:
                        sig["previous_ptr"] = f"*{dtype}:D"
                    if masked:
                        sig["has_prev_ptr"] = "*u1:D"
                    if has_needed:
                        sig["needed_ptr"] = "*u1:D"
                    sig.update({"bias_ptr": "*fp32:D", "weight_ptr": "*fp32:D", "pos_ptr": "*i64:D",
                                "inv_freq_ptr": "*fp32:D", "out_ptr": f"*{dtype}:D", "eps": "fp32", "scaling": "fp32"})
                    nones = {k: None for k, on in (("previous_ptr", overlap), ("has_prev_ptr", masked),
                                                   ("needed_ptr", has_needed)) if not on}
                    variants.append(Variant(sig, {**nones, **const}, cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("compress_entries", _compress_entries_kernel, _aot_variants)


def covers(window: torch.Tensor, previous: torch.Tensor | None, has_previous: torch.Tensor | None,
           position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
           inv_freq: torch.Tensor, rope_scaling: float, needed: torch.Tensor | None = None) -> bool:
    """An even entry width (each program splits its row into pairs) whose rope channels fit one tile."""
    width = position_bias.shape[-1]
    dim = width // 2 if previous is not None else width
    return dim % 2 == 0 and coverage.rope_fits(inv_freq, dim)


def prepare(window: torch.Tensor, previous: torch.Tensor | None, has_previous: torch.Tensor | None,
            position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
            inv_freq: torch.Tensor, rope_scaling: float, needed: torch.Tensor | None = None, *,
            arch: CudaArch) -> Launch:
    """Plan ``compress_entries(...)`` for ``arch``: output allocated, arguments built, nothing launched."""
    n, ratio, _ = window.shape
    overlap = previous is not None
    width = position_bias.shape[-1]
    dim = width // 2 if overlap else width
    if not covers(window, previous, has_previous, position_bias, norm_weight, eps, positions,
                                     inv_freq, rope_scaling, needed):  # each program splits its row into pairs
        raise ValueError(f"compress_entries: an even entry width with a power-of-two count of rope pairs at most "
                         f"half of it expected, got width {dim} and {inv_freq.numel()} pairs")
    half = inv_freq.numel()
    if window.shape[-1] != 2 * width or (previous is not None and previous.shape != (n, ratio, 2 * dim)):
        raise ValueError(f"compress_entries: window {tuple(window.shape)} / previous "
                         f"{None if previous is None else tuple(previous.shape)} do not match width {width}")
    has_previous = has_previous if overlap else None  # a mask of predecessors only matters with overlap
    masked = has_previous is not None
    out = torch.empty((n, dim), dtype=window.dtype, device=window.device)
    cfg, const = _plan(arch, ratio, dim, overlap, masked, needed is not None, 2 * half)
    args = dict(window_ptr=window.contiguous(),
                previous_ptr=None if previous is None else previous.to(window.dtype).contiguous(),
                has_prev_ptr=None if has_previous is None else has_previous.to(torch.bool).contiguous(),
                needed_ptr=None if needed is None else needed.to(torch.bool).contiguous(),
                bias_ptr=position_bias.to(torch.float32).contiguous(), weight_ptr=norm_weight.contiguous(),
                pos_ptr=positions.to(device=window.device, dtype=torch.int64).contiguous(),
                inv_freq_ptr=inv_freq.to(device=window.device, dtype=torch.float32).contiguous(), out_ptr=out,
                eps=float(eps), scaling=float(rope_scaling), **const)
    return Launch((n,), cfg, args, out)


# batch-invariant: one program per window
@override("compress_entries", coverage=covers, batch_invariant=True, aot=(KERNEL,))
def compress_entries(window: torch.Tensor, previous: torch.Tensor | None, has_previous: torch.Tensor | None,
                     position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     inv_freq: torch.Tensor, rope_scaling: float, needed: torch.Tensor | None = None) -> torch.Tensor:
    """Entries [n, dim] in window.dtype of windows [n, r, 2 * width]: pooled, RMS-normalised, rotated; zeros
    where ``needed`` is false (those programs skip the window)."""
    index, arch = cuda_target(window)
    return prepare(window, previous, has_previous, position_bias, norm_weight, eps, positions, inv_freq,
                   rope_scaling, needed, arch=arch).run(KERNEL, index)
