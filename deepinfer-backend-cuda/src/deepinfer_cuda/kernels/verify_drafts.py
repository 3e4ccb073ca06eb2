"""Speculative verification in three Triton launches, no host reads: core's ``verify_drafts`` (ops/speculative.py).

The reference takes ~60 torch launches a step (a log-softmax over every target row, full-vocabulary noise in
float64).  Here:

    _row_stats_kernel  per (request, target row j <= its draft count, chunk of BLOCK_V tokens): the chunk's max,
                       sum of exp(logit - max) and first argmax
    _draw_kernel       per (request, chunk): every program redoes the request's acceptance from the row statistics
                       (K scalar tests: greedy: draft == argmax; sampled: u q(x) <= p(x) in float64, u the hash of
                       (seed, (step + j) ^ ACCEPT_SALT) at token 0), then races its chunk of the row after the
                       accepted drafts: the logits (greedy), the residual max(p - q, 0) against the noise of
                       (seed, pos ^ RESIDUAL_SALT) after a rejection (with p as the fallback race for an all-zero
                       residual), or the plain race of sample_tokens (the bonus token); chunk 0 stores the count
    _pick_kernel       per request: the first chunk holding the best score, then the output row

The noise is sample_tokens' hash, bit for bit (its jitted helpers).  Reductions run over fixed chunks in chunk
order, so a request's result never depends on the batch.  Greedy results equal the reference's exactly (fp32
argmax, first index); sampled decisions may differ only where a near-tie is decided by rounding (the op's compare).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer.ops.speculative import ACCEPT_SALT, RESIDUAL_SALT
from deepinfer_cuda.arch import CudaArch, verify_drafts_config
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.sample_tokens import _neg_log_uniform, _row_key, _token_hash
from deepinfer_cuda.override import override

#: Target dtypes compiled ahead of time (the op takes fp32); sizes are runtime arguments.
AOT_DTYPES = ("fp32",)

_ACCEPT_SALT: tl.constexpr = tl.constexpr(ACCEPT_SALT)
_RESIDUAL_SALT: tl.constexpr = tl.constexpr(RESIDUAL_SALT)
_NO_TOKEN: tl.constexpr = tl.constexpr(0x7FFFFFFF)


@triton.jit(do_not_specialize=["vocab", "rows", "n_chunks"])
def _row_stats_kernel(target_ptr, num_drafts_ptr, max_ptr, sum_ptr, first_ptr, vocab, rows, n_chunks,
                      BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    chunk = tl.program_id(2)
    if j <= tl.load(num_drafts_ptr + b):  # rows past the request's drafts are never read
        tokens = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        x = tl.load(target_ptr + (b * rows + j) * vocab + tokens, mask=tokens < vocab, other=float("-inf"))
        best = tl.max(x, axis=0)
        shift = tl.where(best == float("-inf"), 0.0, best)
        total = tl.sum(libdevice.exp(x - shift), axis=0)
        first = tl.min(tl.where(x == best, tokens, _NO_TOKEN), axis=0)
        slot = (b * rows + j) * n_chunks + chunk
        tl.store(max_ptr + slot, best)
        tl.store(sum_ptr + slot, total)
        tl.store(first_ptr + slot, first)


@triton.jit
def _row_reduce(max_ptr, sum_ptr, first_ptr, base, n_chunks, TILE: tl.constexpr):
    """(log-sum-exp, first argmax) of one target row from its chunks' statistics, ``TILE`` chunks at a time."""
    best = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    first = tl.zeros([], tl.int32)
    for c0 in range(0, n_chunks, TILE):
        c = c0 + tl.arange(0, TILE)
        inside = c < n_chunks
        m = tl.load(max_ptr + base + c, mask=inside, other=float("-inf"))
        s = tl.load(sum_ptr + base + c, mask=inside, other=0.0)
        f = tl.load(first_ptr + base + c, mask=inside, other=_NO_TOKEN)
        tile_best = tl.max(m, axis=0)
        tile_first = tl.min(tl.where(m == tile_best, f, _NO_TOKEN), axis=0)
        new = tl.maximum(best, tile_best)
        shift = tl.where(new == float("-inf"), 0.0, new)
        total = total * libdevice.exp(best - shift) + tl.sum(s * libdevice.exp(m - shift), axis=0)
        first = tl.where(tile_best > best, tile_first, first)
        best = new
    shift = tl.where(best == float("-inf"), 0.0, best)
    return shift + libdevice.log(total), first


@triton.jit
def _race(keyed_race, best_ptr, token_ptr, slot, tokens):
    """Store the chunk's best score and the first token holding it."""
    best = tl.max(keyed_race, axis=0)
    tl.store(best_ptr + slot, best)
    tl.store(token_ptr + slot, tl.min(tl.where(keyed_race == best, tokens, _NO_TOKEN), axis=0))


@triton.jit(do_not_specialize=["vocab", "k", "n_chunks", "drafts_stride", "q_stride_b", "q_stride_k"])
def _draw_kernel(target_ptr, greedy_ptr, drafts_ptr, q_ptr, num_drafts_ptr, seeds_ptr, steps_ptr, max_ptr, sum_ptr,
                 first_ptr, accepted_ptr, best_ptr, token_ptr, vocab, k, n_chunks, drafts_stride, q_stride_b,
                 q_stride_k, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, TILE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    rows = k + 1
    num = tl.load(num_drafts_ptr + b)
    greedy = tl.load(greedy_ptr + b) != 0
    seed = tl.load(seeds_ptr + b)
    step = tl.load(steps_ptr + b)
    accepted = tl.zeros([], tl.int64)
    going = num > 0
    for j in range(0, k):  # the request's acceptance, as every chunk's program needs it
        draft = tl.load(drafts_ptr + b * drafts_stride + j)
        x = tl.minimum(tl.maximum(draft, 0), vocab - 1)
        lse, argmax = _row_reduce(max_ptr, sum_ptr, first_ptr, (b * rows + j) * n_chunks, n_chunks, TILE)
        p_x = libdevice.exp(tl.load(target_ptr + (b * rows + j) * vocab + x) - lse)
        if HAS_Q:
            q_x = tl.load(q_ptr + b * q_stride_b + j * q_stride_k + x)
        else:
            q_x = tl.full([], 1.0, tl.float32)
        key = _row_key(seed, (step + j) ^ tl.full([], _ACCEPT_SALT, tl.int64))
        h = _token_hash(key, tl.zeros([], tl.int32))  # the acceptance noise is uniform_noise's token 0
        u = (h.to(tl.float64) + 0.5) * 2.3283064365386963e-10
        sampled_ok = u * q_x.to(tl.float64) <= p_x.to(tl.float64)
        ok = tl.where(greedy, x == argmax, sampled_ok) & (j < num) & (draft >= 0)
        going = going & ok
        accepted += going.to(tl.int64)
    if chunk == 0:
        tl.store(accepted_ptr + b, accepted)

    tokens = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    row = b * rows + accepted
    logits = tl.load(target_ptr + row * vocab + tokens, mask=tokens < vocab, other=float("-inf"))
    slot = b * 2 * n_chunks + chunk
    if greedy:
        _race(logits, best_ptr, token_ptr, slot, tokens)
        _race(logits, best_ptr, token_ptr, slot + n_chunks, tokens)
    elif accepted < num:  # a rejection: the residual's race, and p's for a residual that is all zero
        key = _row_key(seed, (step + accepted) ^ tl.full([], _RESIDUAL_SALT, tl.int64))
        noise = libdevice.log(_neg_log_uniform(_token_hash(key, tokens)))
        lse, _ = _row_reduce(max_ptr, sum_ptr, first_ptr, row * n_chunks, n_chunks, TILE)
        p = libdevice.exp(logits - lse)
        if HAS_Q:
            q = tl.load(q_ptr + b * q_stride_b + accepted * q_stride_k + tokens, mask=tokens < vocab, other=0.0)
        else:
            rejected = tl.load(drafts_ptr + b * drafts_stride + accepted)
            q = tl.where(tokens == tl.minimum(tl.maximum(rejected, 0), vocab - 1), 1.0, 0.0)
        residual = tl.maximum(p - q, 0.0)
        _race(tl.where(residual > 0, libdevice.log(residual), float("-inf")) - noise, best_ptr, token_ptr, slot,
              tokens)
        _race(logits - noise, best_ptr, token_ptr, slot + n_chunks, tokens)
    else:  # every verified draft passed: the bonus token, sample_tokens' race at the next position
        noise = libdevice.log(_neg_log_uniform(_token_hash(_row_key(seed, step + accepted), tokens)))
        _race(logits - noise, best_ptr, token_ptr, slot, tokens)
        _race(logits - noise, best_ptr, token_ptr, slot + n_chunks, tokens)


@triton.jit(do_not_specialize=["k", "n_chunks", "drafts_stride"])
def _pick_kernel(drafts_ptr, accepted_ptr, best_ptr, token_ptr, out_ptr, k, n_chunks, drafts_stride,
                 TILE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    best = tl.full([], float("-inf"), tl.float32)
    token = tl.zeros([], tl.int32)
    fallback = tl.full([], float("-inf"), tl.float32)
    fallback_token = tl.zeros([], tl.int32)
    base = b * 2 * n_chunks
    for c0 in range(0, n_chunks, TILE):  # chunk order: the first chunk holding the best score wins, as argmax
        c = c0 + tl.arange(0, TILE)
        inside = c < n_chunks
        score = tl.load(best_ptr + base + c, mask=inside, other=float("-inf"))
        tile_best = tl.max(score, axis=0)
        tile_token = tl.min(tl.where(score == tile_best, tl.load(token_ptr + base + c, mask=inside, other=0),
                                     _NO_TOKEN), axis=0)
        token = tl.where(tile_best > best, tile_token, token)
        best = tl.maximum(best, tile_best)
        score = tl.load(best_ptr + base + n_chunks + c, mask=inside, other=float("-inf"))
        tile_best = tl.max(score, axis=0)
        tile_token = tl.min(tl.where(score == tile_best,
                                     tl.load(token_ptr + base + n_chunks + c, mask=inside, other=0), _NO_TOKEN), axis=0)
        fallback_token = tl.where(tile_best > fallback, tile_token, fallback_token)
        fallback = tl.maximum(fallback, tile_best)
    own = tl.where(best == float("-inf"), fallback_token, token).to(tl.int64)  # an all-zero residual: p's race
    accepted = tl.load(accepted_ptr + b)
    for j in range(0, k + 1):
        draft = tl.load(drafts_ptr + b * drafts_stride + j, mask=j < k, other=-1)
        tl.store(out_ptr + b * (k + 1) + j, tl.where(j < accepted, draft, tl.where(j == accepted, own, -1)))


def _aot_variants_stats(arch: CudaArch) -> list[Variant]:
    cfg, _, block_v, _ = verify_drafts_config(arch)
    sig = {"num_drafts_ptr": "*i64:D", "max_ptr": "*fp32:D", "sum_ptr": "*fp32:D", "first_ptr": "*i32:D",
           "vocab": "i32", "rows": "i32", "n_chunks": "i32"}
    return [Variant({"target_ptr": f"*{dtype}:D", **sig}, {"BLOCK_V": block_v}, cfg.num_warps, cfg.num_stages)
            for dtype in AOT_DTYPES]


def _aot_variants_draw(arch: CudaArch) -> list[Variant]:
    """With and without the drafter's probabilities (a greedy drafter passes none)."""
    cfg, _, block_v, tile = verify_drafts_config(arch)
    sig = {"greedy_ptr": "*u1:D", "drafts_ptr": "*i64:D", "q_ptr": "*fp32:D", "num_drafts_ptr": "*i64:D",
           "seeds_ptr": "*i64:D", "steps_ptr": "*i64:D", "max_ptr": "*fp32:D", "sum_ptr": "*fp32:D",
           "first_ptr": "*i32:D", "accepted_ptr": "*i64:D", "best_ptr": "*fp32:D", "token_ptr": "*i32:D",
           "vocab": "i32", "k": "i32", "n_chunks": "i32", "drafts_stride": "i32", "q_stride_b": "i32",
           "q_stride_k": "i32"}
    return [Variant({"target_ptr": f"*{dtype}:D", **sig}, {"HAS_Q": has_q, "BLOCK_V": block_v, "TILE": tile},
                    cfg.num_warps, cfg.num_stages)
            for dtype in AOT_DTYPES for has_q in (True, False)]


def _aot_variants_pick(arch: CudaArch) -> list[Variant]:
    _, cfg, _, tile = verify_drafts_config(arch)
    sig = {"drafts_ptr": "*i64:D", "accepted_ptr": "*i64:D", "best_ptr": "*fp32:D", "token_ptr": "*i32:D",
           "out_ptr": "*i64:D", "k": "i32", "n_chunks": "i32", "drafts_stride": "i32"}
    return [Variant(sig, {"TILE": tile}, cfg.num_warps, cfg.num_stages)]


STATS_KERNEL = TritonKernel("verify_drafts_stats", _row_stats_kernel, _aot_variants_stats)
KERNEL = TritonKernel("verify_drafts", _draw_kernel, _aot_variants_draw)
PICK_KERNEL = TritonKernel("verify_drafts_pick", _pick_kernel, _aot_variants_pick)


def prepare(target: torch.Tensor, greedy: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
            num_drafts: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, *, arch: CudaArch) -> LaunchChain:
    """Plan ``verify_drafts(...)`` for ``arch``: the three launches and their outputs, nothing launched."""
    batch, rows, vocab = target.shape
    k = rows - 1
    device = target.device
    target = target.float().contiguous()
    greedy = greedy.to(device=device, dtype=torch.bool).contiguous()
    num_drafts = num_drafts.to(device=device, dtype=torch.int64).contiguous()
    seeds = seeds.to(device=device, dtype=torch.int64).contiguous()
    steps = steps.to(device=device, dtype=torch.int64).contiguous()
    drafts = draft_tokens.to(device=device, dtype=torch.int64)
    if k == 0 or drafts.stride(-1) != 1:
        drafts = drafts.contiguous() if k else num_drafts  # no draft is read: any int64 tensor will do
    has_q = draft_probs is not None and k > 0
    q = draft_probs.float() if draft_probs is not None and has_q else target
    if q.stride(-1) != 1:
        q = q.contiguous()
    chunk_cfg, pick_cfg, block_v, tile = verify_drafts_config(arch)
    n_chunks = max(1, triton.cdiv(vocab, block_v))
    row_max = torch.empty((batch, rows, n_chunks), dtype=torch.float32, device=device)
    row_sum = torch.empty((batch, rows, n_chunks), dtype=torch.float32, device=device)
    row_first = torch.empty((batch, rows, n_chunks), dtype=torch.int32, device=device)
    accepted = torch.empty(batch, dtype=torch.int64, device=device)
    best = torch.empty((batch, 2, n_chunks), dtype=torch.float32, device=device)
    best_token = torch.empty((batch, 2, n_chunks), dtype=torch.int32, device=device)
    out = torch.empty((batch, rows), dtype=torch.int64, device=device)
    stats = dict(target_ptr=target, num_drafts_ptr=num_drafts, max_ptr=row_max, sum_ptr=row_sum, first_ptr=row_first,
                 vocab=vocab, rows=rows, n_chunks=n_chunks, BLOCK_V=block_v)
    draw = dict(target_ptr=target, greedy_ptr=greedy, drafts_ptr=drafts, q_ptr=q, num_drafts_ptr=num_drafts,
                seeds_ptr=seeds, steps_ptr=steps, max_ptr=row_max, sum_ptr=row_sum, first_ptr=row_first,
                accepted_ptr=accepted, best_ptr=best, token_ptr=best_token, vocab=vocab, k=k, n_chunks=n_chunks,
                drafts_stride=drafts.stride(0) if k else 0, q_stride_b=q.stride(0) if has_q else 0,
                q_stride_k=q.stride(1) if has_q else 0, HAS_Q=has_q, BLOCK_V=block_v, TILE=tile)
    pick = dict(drafts_ptr=drafts, accepted_ptr=accepted, best_ptr=best, token_ptr=best_token, out_ptr=out, k=k,
                n_chunks=n_chunks, drafts_stride=drafts.stride(0) if k else 0, TILE=tile)
    steps_ = [(STATS_KERNEL, Launch((batch, rows, n_chunks), chunk_cfg, stats, None)),
              (KERNEL, Launch((batch, n_chunks), chunk_cfg, draw, None)),
              (PICK_KERNEL, Launch((batch,), pick_cfg, pick, None))]
    return LaunchChain(steps_, lambda: (out, accepted))


# batch-invariant: per request, vocabulary chunks reduced in chunk order; by construction (not yet checked on an H200)
@override("verify_drafts", batch_invariant=True, aot=(STATS_KERNEL, KERNEL, PICK_KERNEL))
def verify_drafts(target: torch.Tensor, greedy: torch.Tensor, draft_tokens: torch.Tensor,
                  draft_probs: torch.Tensor | None, num_drafts: torch.Tensor, seeds: torch.Tensor,
                  steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, K+1] int64, num_accepted [B] int64) of fp32 target rows [B, K+1, V]: core's reference op."""
    index, arch = cuda_target(target)
    return prepare(target, greedy, draft_tokens, draft_probs, num_drafts, seeds, steps, arch=arch).run(index)
