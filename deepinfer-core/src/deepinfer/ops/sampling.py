"""Sampling ops: the per-step math on logits that a device would fuse.

All ops are row-wise, so a row's result never depends on the other rows of the batch.  Logits are
fp32 ``[N, V]`` (what ``CausalLM.compute_logits`` returns).  Randomness is counter-based: the noise
for (seed, step, token) is a stateless integer hash, so a seeded request draws the same tokens alone,
in any batch, and after preemption and recompute.
"""

from __future__ import annotations

import torch

from deepinfer.ops.registry import OpSample, batch_invariant_reference, reference_op
from deepinfer.ops.row_tiles import in_row_tiles
from deepinfer.sampling_params import GREEDY_TEMPERATURE

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32) without int64 overflow (split ``c`` in halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (Wellons' lowbias32), on int64 tensors in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Per-row 32-bit keys from 64-bit seeds (int64, two's complement) and output positions."""
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    return mix32(steps & _MASK32 ^ mix32(hi ^ mix32(lo)))


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) float64 noise ``[N, V]``: a pure function of (seed, step, token id)."""
    tokens = mix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) + 0x9E3779B9 & _MASK32)
    h = mix32(row_keys(seeds, steps)[:, None] ^ tokens[None, :])
    return (h.to(torch.float64) + 0.5) / 4294967296.0


# --------------------------------------------------------------------------------------------------
# Sample inputs (small vocabularies, realistic parameter mixes).
# --------------------------------------------------------------------------------------------------


def _logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=gen) * 3.0


def _penalty_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, vocab in [(1, 50), (5, 1000)]:
        logits = _logits(rows, vocab, gen).to(dtype)
        prompt_mask = torch.rand(rows, vocab, generator=gen) < 0.05
        counts = torch.randint(0, 3, (rows, vocab), generator=gen, dtype=torch.int32)
        counts[torch.rand(rows, vocab, generator=gen) < 0.8] = 0
        presence = torch.linspace(-0.5, 1.5, rows)
        frequency = torch.linspace(0.3, -0.2, rows)
        repetition = torch.linspace(1.0, 1.8, rows)
        yield OpSample((logits, prompt_mask, counts, presence, frequency, repetition), label=f"{rows}x{vocab}")


def _filter_samples(dtype: torch.dtype, gen: torch.Generator):
    rows, vocab = 6, 500
    logits = _logits(rows, vocab, gen).to(dtype)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.5])
    top_k = torch.tensor([0, 0, 20, 0, 1, 50], dtype=torch.int64)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.95])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.1])
    yield OpSample((logits, temperature, top_k, top_p, min_p), label="mixed")
    yield OpSample((logits[:1], temperature[1:2], top_k[:1], top_p[:1], min_p[:1]), label="plain")


def _sample_samples(dtype: torch.dtype, gen: torch.Generator):
    rows, vocab = 5, 300
    logits = _logits(rows, vocab, gen).to(dtype)
    logits[2, 100:] = float("-inf")
    greedy = torch.tensor([False, False, False, True, False])
    seeds = torch.tensor([0, 1, -7, 12345678901234, 2**62], dtype=torch.int64)
    steps = torch.tensor([0, 5, 1, 9, 1000], dtype=torch.int64)
    yield OpSample((logits, greedy, seeds, steps), label="mixed")


def _logprob_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, vocab, k in [(1, 64, 0), (4, 1000, 5)]:
        logits = _logits(rows, vocab, gen).to(dtype)
        tokens = torch.randint(0, vocab, (rows,), generator=gen)
        yield OpSample((logits, tokens, k), label=f"{rows}x{vocab} top{k}")


# --------------------------------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------------------------------


@reference_op(sample_inputs=_penalty_samples, dtypes=(torch.float32,), rows=(0, 1, 2, 3, 4, 5))
def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties (OpenAI / vLLM semantics); returns new logits.

    logits [N, V] float; prompt_mask [N, V] bool (token occurs in the prompt); output_counts [N, V]
    int (occurrences in the output so far); presence, frequency, repetition [N] fp32.
    Repetition divides positive and multiplies negative logits of every seen token (prompt or output);
    frequency subtracts ``count * f``, presence subtracts ``p`` once, both over output tokens only.
    """
    x = logits.float()
    counts = output_counts.to(torch.float32)
    in_output = output_counts > 0
    seen = prompt_mask | in_output
    r = repetition.float()[:, None]
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - frequency.float()[:, None] * counts - presence.float()[:, None] * in_output.float()
    return x.to(logits.dtype)


@reference_op(sample_inputs=_filter_samples, dtypes=(torch.float32,), rows=(0, 1, 2, 3, 4))
def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p truncation; removed tokens get -inf.

    logits [N, V] fp32; temperature [N] fp32 (rows below ``GREEDY_TEMPERATURE`` are left unscaled;
    their sampling is an argmax); top_k [N] int64 (``<= 0``: off; ties at the k-th value are kept);
    top_p [N] fp32 in (0, 1] (smallest set of most likely tokens whose mass reaches ``top_p``);
    min_p [N] fp32 in [0, 1] (drop tokens below ``min_p`` times the top probability).
    The most likely token always survives.  Returns new fp32 logits [N, V].
    """
    vocab = logits.shape[-1]
    t = temperature.float()
    x = logits.float() / torch.where(t < GREEDY_TEMPERATURE, torch.ones_like(t), t)[:, None]
    neg_inf = torch.tensor(float("-inf"), device=x.device)

    probs = torch.softmax(x, dim=-1)
    top_prob = probs.max(dim=-1, keepdim=True).values
    x = torch.where(probs < min_p.float()[:, None] * top_prob, neg_inf, x)

    sorted_x, _ = torch.sort(x, dim=-1, descending=True, stable=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_x.gather(-1, (k - 1)[:, None])
    x = torch.where(x < kth, neg_inf, x)

    sorted_x = torch.where(sorted_x < kth, neg_inf, sorted_x)
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p.float()[:, None]
    keep_sorted[:, 0] = True
    # Threshold = the smallest kept logit; ties with it are kept too (order among ties is arbitrary).
    threshold = torch.where(keep_sorted, sorted_x, torch.full_like(sorted_x, float("inf"))).min(-1, keepdim=True)
    return torch.where(x < threshold.values, neg_inf, x)


@batch_invariant_reference(filter_logits)
def filter_logits_in_tiles(logits, temperature, top_k, top_p, min_p):
    """Fixed tiles of 16 rows: on CUDA the softmax / cumsum behind top-p round by the batch's shape (measured
    on an H200: a token at the top-p edge was kept in one batch and cut in another)."""
    return in_row_tiles(filter_logits, (logits, temperature, top_k, top_p, min_p), rows=(0, 1, 2, 3, 4))


def _race_scores(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1).to(torch.float64)
    return logp - torch.log(-torch.log(uniform_noise(seeds, steps, logits.shape[-1])))


def _compare_samples(actual: torch.Tensor, expected: torch.Tensor, sample: OpSample, dtype: torch.dtype) -> None:
    """Tokens must match, except where another implementation's rounding can flip a near-tie (gap < 1e-4)."""
    logits, greedy, seeds, steps = sample.args
    actual = actual.cpu()
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, "sample_tokens: shape/dtype differ"
    scores = torch.where(greedy[:, None], logits.double(), _race_scores(logits, seeds, steps))
    for i in (actual != expected).nonzero().flatten().tolist():
        gap = (scores[i, expected[i]] - scores[i, actual[i]]).item()
        assert gap < 1e-4, (f"sample_tokens row {i}: token {actual[i].item()} "
                            f"instead of {expected[i].item()} (gap {gap})")


@reference_op(sample_inputs=_sample_samples, dtypes=(torch.float32,), compare=_compare_samples, rows=(0, 1, 2, 3))
def sample_tokens(logits: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Draw one token per row: argmax for greedy rows, else an exponential race with hashed noise.

    logits [N, V] fp32 (already penalised and filtered; -inf = excluded); greedy [N] bool;
    seeds [N] int64 (a request's 64-bit seed); steps [N] int64 (the output position being sampled).
    Row ``i`` picks ``argmax_t log p_t - log(-log u(seed_i, step_i, t))``, i.e. ``argmin E_t / p_t``
    with ``E_t`` exponential: an exact draw from ``softmax(logits)`` whose noise depends only on
    (seed, step, token id).  Returns int64 [N].
    """
    drawn = _race_scores(logits, seeds, steps).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


@reference_op(sample_inputs=_logprob_samples, dtypes=(torch.float32,), rows=(0, 1))
def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of chosen tokens, their ranks, and the top-``num_top`` alternatives.

    logits [N, V] fp32 (raw model logits); token_ids [N] int64; num_top >= 0.
    Returns (logprob [N] fp32, rank [N] int64 = 1 + number of tokens strictly more likely,
    top_ids [N, num_top] int64, top_logprobs [N, num_top] fp32, most likely first).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, token_ids[:, None])
    rank = (logp > chosen).sum(dim=-1) + 1
    if num_top > 0:
        top_logprobs, top_ids = torch.topk(logp, num_top, dim=-1)
    else:
        top_logprobs, top_ids = logp[:, :0], token_ids[:, None][:, :0]
    return chosen[:, 0], rank, top_ids, top_logprobs
