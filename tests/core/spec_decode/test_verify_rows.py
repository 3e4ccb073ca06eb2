"""The verifier's host side (spec_decode/verify.py): each draft's target row is processed like plain sampling at that
output position, with the drafts before it counted as output (penalties) and the grammar's mask after them."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import OpTable
from deepinfer.sample.sampler import Sampler
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec_decode.verify import forced, verify, verify_rows
from deepinfer.step import SamplingRow

V = 8


def _logits() -> torch.Tensor:
    """Row 0 prefers 3; rows 1 and 2 prefer 3 narrowly over 4 (5.0 against 4.9)."""
    x = torch.zeros(3, V)
    x[0, 3] = 5.0
    x[1:, 3], x[1:, 4] = 5.0, 4.9
    return x


def test_rows_count_earlier_drafts_as_output_and_advance_the_position():
    row = SamplingRow(SamplingParams(temperature=0.0), seed=7, step=4, prompt_ids=[1], output_ids=[2])
    rows = verify_rows(row, [3, 4])
    assert [r.step for r in rows] == [4, 5, 6]
    assert [r.output_ids for r in rows] == [[2], [2, 3], [2, 3, 4]]
    assert row.output_ids == [2]  # the request's row is left alone
    assert [r.output_ids for r in verify_rows(row, 2)] == [[2]] * 3  # drafts left on the device
    penalised = SamplingRow(SamplingParams(presence_penalty=0.5), seed=7, step=4, prompt_ids=[1], output_ids=[2])
    with pytest.raises(ValueError, match="penalties needs its drafts"):
        verify_rows(penalised, 2)


def test_penalties_see_the_drafts_before_each_row():
    sampler = Sampler(OpTable())
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)  # a seen 3 drops to 2.5, below 4's 4.9
    row = SamplingRow(params, seed=0, step=0, prompt_ids=[0], output_ids=[])
    tokens, accepted = verify(OpTable(), sampler, _logits(), [verify_rows(row, [3, 4])], torch.tensor([[3, 4]]),
                              [2], None)
    assert accepted.tolist() == [2]  # row 1 penalises the drafted 3, so its argmax is the drafted 4
    plain = SamplingParams(temperature=0.0)
    row = SamplingRow(plain, seed=0, step=0, prompt_ids=[0], output_ids=[])
    tokens, accepted = verify(OpTable(), sampler, _logits(), [verify_rows(row, [3, 4])], torch.tensor([[3, 4]]),
                              [2], None)
    assert accepted.tolist() == [1] and tokens.tolist() == [[3, 3, -1]]  # without the penalty row 1 wants 3


def test_min_tokens_bans_eos_at_each_rows_own_position():
    sampler = Sampler(OpTable(), eos_token_ids=(4,))
    params = SamplingParams(temperature=0.0, min_tokens=2)
    logits = torch.zeros(3, V)
    logits[:, 4] = 9.0  # EOS first everywhere; 1 second
    logits[:, 1] = 8.0
    row = SamplingRow(params, seed=0, step=1, prompt_ids=[0], output_ids=[5])
    tokens, accepted = verify(OpTable(), sampler, logits, [verify_rows(row, [1, 4])], torch.tensor([[1, 4]]), [2],
                              None)
    # position 1 is still below min_tokens (EOS banned: 1 is the argmax); position 2 may end
    assert accepted.tolist() == [2] and tokens.tolist() == [[1, 4, 4]]


def test_forced_acceptance_takes_the_drafts_then_the_plain_token():
    sampler = Sampler(OpTable())
    row = SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0, prompt_ids=[0], output_ids=[])
    tokens, accepted = forced(sampler, _logits(), [verify_rows(row, 2)], torch.tensor([[6, 7]]), [2], [1])
    assert accepted.tolist() == [1] and tokens.tolist() == [[6, 3, -1]]
