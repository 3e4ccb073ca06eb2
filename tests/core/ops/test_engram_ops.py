"""The Engram ops against independent transcriptions of the reference's formulas (spec §9.4, §9.5)."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.backends.cpu import CpuBackend
from deepinfer.ops import OpTable, op_defs
from deepinfer.testing import check_op, samples

OPS = OpTable()


def _hash_in_python(lookback: list[int], multipliers: list[int], primes: list[int], offsets: list[int]) -> list[int]:
    """§9.4 with Python integers, one n-gram size after another."""
    heads = len(primes) // (len(lookback) - 1)
    rows, rolling = [], lookback[0] * multipliers[0]
    for s in range(1, len(lookback)):
        rolling ^= lookback[s] * multipliers[s]
        for h in range(heads):
            c = (s - 1) * heads + h
            rows.append(rolling % primes[c] + offsets[c])
    return rows


def test_engram_hash_equals_the_formula_in_python_integers():
    for case in samples(op_defs()["engram_hash"], torch.int64):
        lookback, multipliers, primes, offsets = case.args
        out = OPS.engram_hash(*case.args)
        assert out.dtype == torch.int64 and out.shape == (lookback.shape[0], primes.shape[0])
        for t in range(lookback.shape[0]):
            assert out[t].tolist() == _hash_in_python(lookback[t].tolist(), multipliers.tolist(), primes.tolist(),
                                                      offsets.tolist()), f"{case.label} row {t}"


def _gate_in_float64(streams, key, value, q_weight, k_weight, eps):
    h, k, v = streams.double(), key.double(), value.double()
    dim = h.shape[-1]
    out = torch.empty_like(h)
    for t in range(h.shape[0]):
        for s in range(h.shape[1]):
            norm_h = math.sqrt(float((h[t, s] ** 2).mean()) + eps)
            norm_k = math.sqrt(float((k[t, s] ** 2).mean()) + eps)
            dot = float((h[t, s] * q_weight[s].double() * k_weight[s].double() * k[t, s]).sum())
            dot = dot / norm_h / norm_k / math.sqrt(dim)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            out[t, s] = h[t, s] + gate * v[t]
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_engram_gate_equals_the_formula(dtype, tol):
    gen = torch.Generator().manual_seed(3)
    streams, key = torch.randn(2, 6, 4, 48, generator=gen).to(dtype)
    value = torch.randn(6, 48, generator=gen).to(dtype)
    q_w, k_w = (1 + 0.3 * torch.randn(2, 4, 48, generator=gen)).to(dtype)
    out = OPS.engram_gate(streams, key, value, q_w, k_w, 1e-20)
    assert out.dtype == dtype
    expected = _gate_in_float64(streams, key, value, q_w, k_w, 1e-20)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_engram_gate_of_a_tiny_dot_is_the_floor_with_the_dot_s_sign():
    streams = torch.tensor([[[1.0, 1.0]], [[1.0, 1.0]]])  # one stream, D = 2
    key = torch.tensor([[[0.0, 0.0]], [[1.0, -(1 + 2.0**-20)]]])  # dot = +0, and about -7e-7
    value = torch.ones(2, 2)
    out = OPS.engram_gate(streams, key, value, torch.ones(1, 2), torch.ones(1, 2), 1e-20)
    gate = torch.sigmoid(torch.tensor([1e-3, -1e-3]))  # sqrt(1e-6), signed
    torch.testing.assert_close(out[:, 0], streams[:, 0] + gate[:, None], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["engram_hash", "engram_gate"])
def test_conformance_suite_runs(name):
    for dtype in op_defs()[name].dtypes:
        assert check_op(CpuBackend(), name, dtype) > 0
