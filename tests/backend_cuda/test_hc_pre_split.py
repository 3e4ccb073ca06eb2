"""The arithmetic of ``hc_pre``'s bf16-term projection, in plain torch (CPU; Triton's interpreter cannot run a
bf16 ``tl.dot``): fn == hi + mid + lo exactly, x * x == two bf16 halves exactly, and the kernel's accumulation
order (per step of ``block_k`` columns: hi, then mid, then lo, into one fp32 accumulator) is as accurate as the
IEEE fp32 FMA chain it replaced, measured against float64.
"""

from __future__ import annotations

import torch


def _terms(f: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The kernel's _bf16_terms: each term the bf16 rounding (nearest-even) of what the previous ones left."""
    hi = f.bfloat16()
    rest = f - hi.float()
    mid = rest.bfloat16()
    lo = (rest - mid.float()).bfloat16()
    return [hi, mid, lo][:count]


def _chained(x: torch.Tensor, parts: list[torch.Tensor], block_k: int, step: int = 16) -> torch.Tensor:
    """The kernel's order: per ``block_k`` columns, hi into one fp32 accumulator and then mid, lo into a second, in
    ``step``-column dots (wgmma's k16: its products exact, bf16 x bf16, summed in fp32 here as a stand-in)."""
    big = torch.zeros(x.shape[0], parts[0].shape[0])
    small = torch.zeros_like(big)
    for k0 in range(0, x.shape[1], block_k):
        for i, p in enumerate(parts):
            for j in range(k0, k0 + block_k, step):
                term = x[:, j:j + step].float() @ p[:, j:j + step].float().T
                if i == 0:
                    big = big + term
                else:
                    small = small + term
    return big + small


def _fma_chain(x: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """The IEEE fp32 kernel it replaces: one rounding per column (fp32 product then sum, a bound on an FMA's)."""
    acc = torch.zeros(x.shape[0], fn.shape[0])
    xf = x.float()
    for k in range(x.shape[1]):
        acc = acc + xf[:, k:k + 1] * fn[:, k]
    return acc


def test_bf16_terms_are_exact_and_as_accurate_as_fp32_fmas():
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    k = 8192
    x = (2 * torch.randn(8, k, generator=gen)).bfloat16()
    fn = 0.05 * torch.randn(24, k, generator=gen) * torch.logspace(-3, 1, k)[torch.randperm(k, generator=gen)]
    three = _terms(fn, 3)
    assert torch.equal(sum(t.double() for t in three), fn.double())  # all 24 bits of every weight
    sq = x.float().square()
    sq_hi = sq.bfloat16()
    assert torch.equal(sq_hi.double() + (sq - sq_hi.float()).bfloat16().double(), sq.double())

    exact = x.double() @ fn.double().T
    err_fp32 = (_fma_chain(x, fn).double() - exact).abs().max().item()
    for block_k in (32, 64, 128):  # fewer roundings than one per column: more accurate than the FMA chain
        err3 = (_chained(x, three, block_k).double() - exact).abs().max().item()
        assert err3 <= err_fp32, (block_k, err3, err_fp32)
    # Two terms drop fn's last 8 bits: measurably worse than three (about the FMA chain's error).
    err2 = (_chained(x, _terms(fn, 2), 64).double() - exact).abs().max().item()
    assert err2 > err3, (err2, err3)
