"""Engram's n-gram hash (V4.1) as one Triton pass over int64 tiles of tokens x table columns.

Overrides core's ``engram_hash(lookback, multipliers, primes, offsets)`` (deepinfer/ops/engram.py): for column
``c = (n - 2) * heads + h`` the n-gram ending at a token hashes to ``XOR_{s<n} lookback[s] * multipliers[s]`` and
its table row is that ``% primes[c] + offsets[c]``.  One program per ``block_rows`` tokens holds all C columns:
the N products of a token are formed once and XOR-ed into the columns whose n-gram reaches them (a column-wise
mask), then one modulo and one store (the reference: N products, N - 1 XORs, a repeat_interleave, a modulo and an
add, each a kernel).  Exact integer arithmetic, so bit for bit.  The reference's inputs make every product and
XOR non-negative (ids >= 0, odd multipliers small enough not to overflow), where C's remainder (``%`` here) is
Python's (torch's).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, LaunchConfig, engram_hash_config
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.override import override

#: (look-back width N = max n-gram size, hash heads) compiled ahead of time: V4.1-Flash's defaults (4, 8).
AOT_SHAPES = ((4, 8),)


@triton.jit(do_not_specialize=["tokens", "lookback_stride"])
def _engram_hash_kernel(lookback_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr, tokens, lookback_stride,
                        N: tl.constexpr, HEADS: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_T: tl.constexpr):
    wait_for_producers()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < tokens
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < C
    order = cols // HEADS + 2  # the n-gram size of each column
    src = lookback_ptr + rows.to(tl.int64) * lookback_stride
    hashed = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.int64)
    for s in tl.static_range(N):
        product = tl.load(src + s, mask=row_ok, other=0) * tl.load(mult_ptr + s)  # [BLOCK_T] int64
        hashed = hashed ^ tl.where((s < order)[None, :], product[:, None], 0)
    primes = tl.load(primes_ptr + cols, mask=col_ok, other=1)
    offsets = tl.load(offsets_ptr + cols, mask=col_ok, other=0)
    out = hashed % primes[None, :] + offsets[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


@functools.cache
def _plan(arch: CudaArch, n: int, columns: int) -> tuple[LaunchConfig, dict[str, object]]:
    cfg = engram_hash_config(arch)
    heads = columns // (n - 1)
    return cfg, {"N": n, "HEADS": heads, "C": columns, "BLOCK_C": max(2, triton.next_power_of_2(columns)),
                 "BLOCK_T": cfg.block_rows}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    variants = []
    for n, heads in AOT_SHAPES:
        cfg, const = _plan(arch, n, (n - 1) * heads)
        sig = {"lookback_ptr": "*i64:D", "mult_ptr": "*i64:D", "primes_ptr": "*i64:D", "offsets_ptr": "*i64:D",
               "out_ptr": "*i64:D", "tokens": "i32", "lookback_stride": "i32"}
        variants.append(Variant(sig, dict(const), cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("engram_hash", _engram_hash_kernel, _aot_variants)


def prepare(lookback: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor, *,
            arch: CudaArch) -> Launch:
    """Plan ``engram_hash(...)`` for ``arch``: output allocated, nothing launched."""
    tokens, n = lookback.shape
    columns = primes.shape[0]
    if n < 2 or columns % (n - 1):
        raise ValueError(f"engram_hash: primes has {columns} columns, not a multiple of the {n - 1} n-gram sizes "
                         f"of a look-back of width {n} (>= 2)")
    device = lookback.device
    if lookback.stride(-1) != 1:
        lookback = lookback.contiguous()
    mult, primes, offsets = (t.to(device, torch.int64).contiguous() for t in (multipliers, primes, offsets))
    out = torch.empty((tokens, columns), dtype=torch.int64, device=device)
    cfg, const = _plan(arch, n, columns)
    args = dict(lookback_ptr=lookback, mult_ptr=mult, primes_ptr=primes, offsets_ptr=offsets, out_ptr=out,
                tokens=tokens, lookback_stride=lookback.stride(0), **const)
    return Launch((triton.cdiv(tokens, cfg.block_rows),), cfg, args, out)


# batch-invariant: per token; by construction (not yet checked on an H200)
@override("engram_hash", batch_invariant=True, aot=(KERNEL,))
def engram_hash(lookback: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
    """Table rows [T, C] int64 of each token's n-grams from its look-back compressed ids [T, N] int64."""
    index, arch = cuda_target(lookback)
    return prepare(lookback, multipliers, primes, offsets, arch=arch).run(KERNEL, index)
