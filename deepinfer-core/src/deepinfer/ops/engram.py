"""Engram (DeepSeek-V4.1): a hashed n-gram memory gated into the residual streams.

``engram_hash`` turns each token's look-back compressed ids into table rows; ``engram_gate`` adds the looked-up
value to every stream, gated by how well the stream matches the looked-up key.  (Building the look-back rows,
the table gather and the ``wkv`` projection are in ``deepinfer.models.deepseek_v41.engram``.)
"""

from __future__ import annotations

import torch

from deepinfer.ops.registry import OpSample, batch_invariant_reference, reference_op
from deepinfer.ops.row_tiles import in_row_tiles

#: Floor of |dot| under the gate's square root (the reference's clamp value).
GATE_DOT_FLOOR = 1e-6


def _hash_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, lookback, heads, vocab in [(1, 3, 3, 318), (19, 4, 2, 435), (40, 4, 8, 99092)]:
        ids = torch.randint(0, vocab, (rows, lookback), generator=gen)
        bound = (2**63 - 1) // vocab // 2
        multipliers = torch.randint(0, bound, (lookback,), generator=gen) * 2 + 1
        primes = torch.tensor([101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157, 163, 167, 173, 179, 181,
                               191, 193, 197, 199, 211, 223, 227])[: (lookback - 1) * heads]
        offsets = torch.cumsum(primes, 0) - primes
        yield OpSample((ids, multipliers, primes, offsets), label=f"{rows} rows, n<={lookback}, {heads} heads")


@reference_op(sample_inputs=_hash_samples, dtypes=(torch.int64,), rows=(0,))
def engram_hash(
    lookback: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Engram table rows of one layer for each token, from its look-back compressed ids.

    lookback: [T, N] int64, column s = compressed id of the token s positions back (the pad id where that
    reaches before the sequence); multipliers: [N] int64 (odd, small enough that ``id * multiplier`` never
    overflows); primes, offsets: [C] int64 with C = (N - 1) * heads, column ``c = (n - 2) * heads + h`` for
    n-gram size n in 2..N.  The n-gram ending at a token hashes to ``x_n = XOR_{s<n} lookback[s] * mult[s]``;
    its row is ``x_n % primes[c] + offsets[c]``.  Returns [T, C] int64.
    """
    products = lookback * multipliers
    rolling, per_order = products[:, 0], []
    for s in range(1, lookback.shape[1]):
        rolling = rolling ^ products[:, s]
        per_order.append(rolling)
    heads = primes.shape[0] // len(per_order)
    return torch.stack(per_order, 1).repeat_interleave(heads, dim=1) % primes + offsets


def _gate_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, streams, dim in [(1, 2, 64), (7, 4, 48), (33, 4, 256)]:
        h = torch.randn(rows, streams, dim, generator=gen).to(dtype)
        key = torch.randn(rows, streams, dim, generator=gen).to(dtype)
        value = torch.randn(rows, dim, generator=gen).to(dtype)
        q_w, k_w = (1 + 0.3 * torch.randn(2, streams, dim, generator=gen)).to(dtype)
        if rows > 1:  # an exactly orthogonal stream: dot = 0, the gate's floor
            key[1, 0] = 0.0
        yield OpSample((h, key, value, q_w, k_w, 1e-20), label=f"{rows}x{streams}x{dim}")


@reference_op(sample_inputs=_gate_samples, rows=(0, 1, 2))
def engram_gate(
    streams: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The residual streams plus the Engram value, gated per stream.

    streams, key: [T, S, D]; value: [T, D]; q_weight, k_weight: [S, D] (only their product is used).
    Per token and stream, all in fp32: ``dot = sum(h * q_weight * k_weight * key) * rsqrt(mean(h^2) + eps)
    * rsqrt(mean(key^2) + eps) / sqrt(D)`` (each normalised over D alone), ``gate = sigmoid(sign(dot) *
    sqrt(max(|dot|, 1e-6)))`` (the sign of a zero dot included), ``out = h + gate * value``.
    Returns [T, S, D] in streams.dtype.
    """
    h, k = streams.float(), key.float()
    weight = q_weight.float() * k_weight.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(k.square().mean(-1) + eps)
    dot = (h * weight * k).sum(-1) * rstd * streams.shape[-1] ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_DOT_FLOOR).sqrt(), dot))
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)


@batch_invariant_reference(engram_gate)
def engram_gate_in_tiles(streams, key, value, q_weight, k_weight, eps):
    """The gate on fixed tiles of 16 tokens: CPU reductions over D vectorise differently with the number of rows
    (measured: a one-token step's gate differed from a 40-token step's in the last bit)."""
    return in_row_tiles(engram_gate, (streams, key, value, q_weight, k_weight, eps), (0, 1, 2))
