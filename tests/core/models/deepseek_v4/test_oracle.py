"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM (eager, exact) on tiny random checkpoints.

Teacher-forced log-probabilities of every position must agree within 1e-4 whether the sequence is fed
whole, in chunks of 1, 3, 7 or 64 tokens, or inside a ragged batch of other sequences.  The sequences cross
many CSA and HCA windows and produce more compressed entries than ``index_topk``, so the indexer selects.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.models import load_model
from deepinfer.ops import OpTable
from tests.support.model_runs import assert_matches_hf, run_chunked, run_ragged
from tests.support.v4_fixtures import (
    RELEASED_RATES,
    SMALL,
    build_checkpoint,
    hf_logprobs,
    random_tokens,
    single_thread,  # noqa: F401  (autouse)
)

SMALL_LEN = 100  # 25 CSA entries (top-8 kept), 6 HCA entries, 16-token window
RELEASED_LEN = 300  # 75 CSA entries (top-16), 2 HCA entries at rate 128, 128-token window


def _setup(tmp_path_factory, config, length, seed):
    path, hf = build_checkpoint(tmp_path_factory.mktemp("v4"), config, seed=seed)
    model = load_model(path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    tokens = random_tokens(length, config["vocab_size"], seed=seed + 1)
    return model, hf, tokens, hf_logprobs(hf, tokens)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return _setup(tmp_path_factory, SMALL, SMALL_LEN, seed=0)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return _setup(tmp_path_factory, RELEASED_RATES, RELEASED_LEN, seed=10)


def test_indexer_really_selects(small, released):
    for model, _, tokens, _ in (small, released):
        csa = [layer for layer in model.layers if layer.attn.indexer is not None]
        assert csa and len(tokens) // csa[0].attn.ratio > 2 * model.config.index_topk


@pytest.mark.parametrize("chunk", [None, 64, 7, 3, 1])
def test_small_config_matches_hf(small, chunk):
    model, _, tokens, expected = small
    assert_matches_hf(run_chunked(model, tokens, chunk or len(tokens)), expected)


@pytest.mark.parametrize("chunk", [None, 64, 7])
def test_released_rates_match_hf(released, chunk):
    model, _, tokens, expected = released
    assert_matches_hf(run_chunked(model, tokens, chunk or len(tokens)), expected)


def test_released_rates_token_by_token_after_prefill(released):
    """Decode steps across an HCA boundary (position 255) after a 250-token prefill."""
    model, _, tokens, expected = released
    from deepinfer.models import ForwardBatch

    state = model.new_state()
    prefill = 250
    with torch.no_grad():
        batch = ForwardBatch(tokens[:prefill], torch.arange(prefill), [prefill], [state])
        out = [model.compute_logits(model.forward(batch))]
        for pos in range(prefill, 270):
            batch = ForwardBatch(tokens[pos : pos + 1], torch.tensor([pos]), [1], [state])
            out.append(model.compute_logits(model.forward(batch)))
    assert_matches_hf(torch.log_softmax(torch.cat(out), dim=-1), expected[:270])


def test_ragged_batch_matches_hf(small):
    """Three prompts of different lengths, joining at different steps, mixing prefill chunks and decodes."""
    model, hf, _, _ = small
    lengths = [SMALL_LEN, 61, 37]
    sequences = [random_tokens(n, SMALL["vocab_size"], seed=20 + i) for i, n in enumerate(lengths)]
    gen = torch.Generator().manual_seed(3)
    schedule, left, step = [], list(lengths), 0
    while any(left):
        row = []
        for i, n in enumerate(left):
            joined = step >= 2 * i  # sequence i joins at step 2i
            size = 0 if not joined or n == 0 else min(n, int(torch.randint(1, 24, (1,), generator=gen)))
            row.append(size if torch.rand(1, generator=gen).item() > 0.2 or size == n else 1 if n else 0)
            left[i] -= row[-1]
        if any(row):
            schedule.append(row)
        step += 1
    assert any(sum(1 for n in row if n) == 3 for row in schedule), "the schedule never batches all three"
    for got, tokens in zip(run_ragged(model, sequences, schedule), sequences, strict=True):
        assert_matches_hf(got, hf_logprobs(hf, tokens))
