"""Token sampling in one Triton pass: greedy argmax, or the exponential race over the reference's hashed noise.

Overrides core's ``sample_tokens(logits, greedy, seeds, steps)`` (deepinfer/ops/sampling.py).  The reference draws
row ``i``'s token as ``argmax_t log p_t - log(-log u_t)`` with ``u_t`` a 32-bit integer hash of (seed, step, token
id) (``uniform_noise`` / ``mix32``).  The kernel recomputes that hash bit for bit in uint32 arithmetic, so a seeded
request races the same noise on the GPU as on the CPU, and draws the same token wherever the race is not decided by
rounding (the reference's gap tolerance, see its ``compare``).

    _sample_kernel     per (row, chunk of BLOCK_V tokens): score = logit (greedy) or logit - log(-log u) in fp32;
                       the chunk's best score and its first token id
    finish (torch)     per row, the first chunk holding the best score; its token

Dropping the row's log-sum-exp changes no argmax.  ``-log u`` is evaluated without cancellation on both halves of
(0, 1): ``-log u`` directly below 1/2, ``-log1p(-(1 - u))`` (Kahan's form, exact ``1 - u`` from the complement of
the hash) above, so the race's winners, whose ``u`` lies near 1, keep full fp32 precision.  The chunk size is fixed,
so a row's result never depends on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer_cuda.arch import CudaArch, sample_tokens_config
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.override import override

#: Logits dtypes compiled ahead of time (the op takes fp32); sizes are runtime arguments, so one variant per dtype.
AOT_DTYPES = ("fp32",)


@triton.jit
def _mix32(x):
    """Wellons' lowbias32 on uint32 (wrapping products): ``deepinfer.ops.sampling.mix32``."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _neg_log_uniform(h):
    """``-log u`` of ``u = (h + 0.5) / 2**32`` (``uniform_noise``), in fp32 without cancellation near u = 1."""
    low = h < 0x80000000
    u = (h.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    v = ((0xFFFFFFFF - h).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 1 - u, exactly up to one rounding
    w = 1.0 - v
    w_safe = tl.where(w == 1.0, 0.5, w)
    log1p_neg_v = tl.where(w == 1.0, -v, libdevice.log(w_safe) * (-v) / (w_safe - 1.0))
    return tl.where(low, -libdevice.log(u), -log1p_neg_v)


@triton.jit
def _row_key(seed, step):
    """``deepinfer.ops.sampling.row_keys``: the uint32 key of an int64 seed and int64 output position."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _mix32((step & 0xFFFFFFFF).to(tl.uint32) ^ _mix32(hi ^ _mix32(lo)))


@triton.jit
def _token_hash(key, tokens):
    """The uint32 hash behind ``uniform_noise`` of the row with ``key`` at token ids ``tokens``."""
    return _mix32(key ^ _mix32(tokens.to(tl.uint32) + 0x9E3779B9))


@triton.jit(do_not_specialize=["vocab", "row_stride", "n_chunks"])
def _sample_kernel(logits_ptr, greedy_ptr, seeds_ptr, steps_ptr, best_score_ptr, best_token_ptr, vocab, row_stride,
                   n_chunks, BLOCK_V: tl.constexpr):
    wait_for_producers()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    tokens = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = tokens < vocab
    logits = tl.load(logits_ptr + row * row_stride + tokens, mask=in_vocab, other=float("-inf")).to(tl.float32)
    if tl.load(greedy_ptr + row) != 0:
        score = logits
    else:
        key = _row_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
        score = logits - libdevice.log(_neg_log_uniform(_token_hash(key, tokens)))
    best = tl.max(score, axis=0)
    first = tl.min(tl.where(score == best, tokens, 0x7FFFFFFF), axis=0)  # the first token holding it, as argmax
    tl.store(best_score_ptr + row * n_chunks + chunk, best)
    tl.store(best_token_ptr + row * n_chunks + chunk, first)


def _aot_variants(arch: CudaArch) -> list[Variant]:
    """Contiguous logits, bool greedy flags, int64 seeds and steps; sizes are runtime arguments (any vocabulary)."""
    cfg, block_v = sample_tokens_config(arch)
    sig = {"greedy_ptr": "*u1:D", "seeds_ptr": "*i64:D", "steps_ptr": "*i64:D", "best_score_ptr": "*fp32:D",
           "best_token_ptr": "*i32:D", "vocab": "i32", "row_stride": "i32", "n_chunks": "i32"}
    return [Variant({"logits_ptr": f"*{dtype}:D", **sig}, {"BLOCK_V": block_v}, cfg.num_warps, cfg.num_stages)
            for dtype in AOT_DTYPES]


KERNEL = TritonKernel("sample_tokens", _sample_kernel, _aot_variants)


def _winners(best_score: torch.Tensor, best_token: torch.Tensor) -> torch.Tensor:
    """Per row, the token of the first chunk with the best score (``argmax`` returns the first maximum)."""
    chunk = best_score.argmax(dim=1, keepdim=True)
    return best_token.gather(1, chunk)[:, 0].to(torch.int64)


def prepare(logits: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, *,
            arch: CudaArch) -> LaunchChain:
    """Plan ``sample_tokens(...)`` for ``arch``: the race kernel's launch and the per-row pick, nothing launched."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    device = logits.device
    greedy = greedy.to(device=device, dtype=torch.bool).contiguous()
    seeds = seeds.to(device=device, dtype=torch.int64).contiguous()
    steps = steps.to(device=device, dtype=torch.int64).contiguous()
    cfg, block_v = sample_tokens_config(arch)
    n_chunks = max(1, triton.cdiv(vocab, block_v))
    best_score = torch.empty((rows, n_chunks), dtype=torch.float32, device=device)
    best_token = torch.empty((rows, n_chunks), dtype=torch.int32, device=device)
    args = dict(logits_ptr=logits, greedy_ptr=greedy, seeds_ptr=seeds, steps_ptr=steps, best_score_ptr=best_score,
                best_token_ptr=best_token, vocab=vocab, row_stride=logits.stride(0), n_chunks=n_chunks,
                BLOCK_V=block_v)
    launch = Launch((rows, n_chunks), cfg, args, None)
    return LaunchChain([(KERNEL, launch)], lambda: _winners(best_score, best_token))


# batch-invariant: per row, fixed vocabulary chunks; checked on an H200
@override("sample_tokens", batch_invariant=True, aot=(KERNEL,))
def sample_tokens(logits: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One token per row [N] int64 of fp32 logits [N, V]: argmax where ``greedy``, else the seeded race."""
    index, arch = cuda_target(logits)
    return prepare(logits, greedy, seeds, steps, arch=arch).run(index)
