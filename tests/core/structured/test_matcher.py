"""The per-request matcher: accept, masks, termination, rollback, fork and draft masks for speculation."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from deepinfer.structured import (
    allocate_token_bitmask,
    fill_draft_token_bitmask,
    grammar_compiler,
    token_allowed,
)
from tests.support.structured import build_tokenizer, decode_random

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return grammar_compiler(tokenizer, len(tokenizer) + 5)


@pytest.fixture(scope="module")
def sequence(compiler, tokenizer) -> list[int]:
    """A complete valid output, stop token included."""
    outputs, done = decode_random([compiler.matcher({"json_schema": SCHEMA})], compiler.vocab_size,
                                  temperature=1.0, seed=11, eos_id=tokenizer.eos_token_id)
    assert done[0]
    return outputs[0] + [tokenizer.eos_token_id]


def _mask(matcher, vocab_size) -> torch.Tensor:
    bitmask = allocate_token_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def _masks_along(matcher, tokens, vocab_size) -> list[torch.Tensor]:
    """The mask before each token, accepting as it goes (the reference for rollback and drafts)."""
    masks = []
    for token in tokens:
        masks.append(_mask(matcher, vocab_size))
        assert matcher.accept(token)
    return masks


def test_rollback_restores_masks_and_termination(compiler, sequence):
    vocab = compiler.vocab_size
    matcher = compiler.matcher({"json_schema": SCHEMA})
    masks = _masks_along(matcher, sequence, vocab)
    assert matcher.is_terminated() and matcher.num_accepted == len(sequence)
    assert len({tuple(m.tolist()) for m in masks}) > 3, "masks must differ along the way for this test to mean much"

    matcher.rollback(1)  # un-accept the stop token
    assert not matcher.is_terminated() and matcher.is_completed()
    assert torch.equal(_mask(matcher, vocab), masks[-1])
    k = len(sequence) // 2
    matcher.rollback(len(sequence) - 1 - k)
    assert matcher.num_accepted == k and not matcher.is_completed()
    assert torch.equal(_mask(matcher, vocab), masks[k])
    replay = _masks_along(matcher, sequence[k:], vocab)
    assert all(torch.equal(a, b) for a, b in zip(replay, masks[k:], strict=True))
    assert matcher.is_terminated()
    matcher.rollback(len(sequence))
    assert torch.equal(_mask(matcher, vocab), masks[0])


def test_replaying_after_rollback_gives_the_same_masks(compiler, sequence):
    vocab = compiler.vocab_size
    matcher = compiler.matcher({"json_schema": SCHEMA})
    masks = _masks_along(matcher, sequence, vocab)
    k = 3
    matcher.rollback(len(sequence) - k)
    replay = _masks_along(matcher, sequence[k:], vocab)
    assert all(torch.equal(a, b) for a, b in zip(replay, masks[k:], strict=True))


def test_rollback_beyond_history_is_refused_and_harmless(compiler, sequence):
    matcher = compiler.matcher({"json_schema": SCHEMA})
    for token in sequence[:4]:
        assert matcher.accept(token)
    before = _mask(matcher, compiler.vocab_size)
    for bad in (5, -1):
        with pytest.raises(ValueError, match=rf"cannot roll back {bad} tokens: 4 accepted"):
            matcher.rollback(bad)
    assert matcher.num_accepted == 4 and torch.equal(_mask(matcher, compiler.vocab_size), before)


def test_disallowed_tokens_are_rejected_without_changing_state(compiler, tokenizer, sequence):
    vocab = compiler.vocab_size
    matcher = compiler.matcher({"json_schema": SCHEMA})
    before = _mask(matcher, vocab)
    disallowed = next(t for t in range(len(tokenizer)) if not token_allowed(before[None], 0, t))
    for token in (disallowed, len(tokenizer) + 1, vocab, -1):  # ungrammatical, padding, out of range
        assert not matcher.accept(token)
    assert matcher.num_accepted == 0 and torch.equal(_mask(matcher, vocab), before)


def test_terminated_matcher_allows_only_stop_tokens(compiler, tokenizer, sequence):
    vocab = compiler.vocab_size
    matcher = compiler.matcher({"json_schema": SCHEMA})
    for token in sequence:
        assert matcher.accept(token)
    allowed = xgr.testing.bitmask_to_bool_mask(_mask(matcher, vocab)[None], vocab)[0]
    assert allowed.nonzero().flatten().tolist() == sorted(matcher.stop_token_ids) == [tokenizer.eos_token_id]
    assert not matcher.accept(sequence[0])


def test_fork_is_independent(compiler, sequence):
    vocab = compiler.vocab_size
    matcher = compiler.matcher({"json_schema": SCHEMA})
    for token in sequence[:3]:
        matcher.accept(token)
    fork = matcher.fork()
    assert fork.num_accepted == 3 and torch.equal(_mask(fork, vocab), _mask(matcher, vocab))
    for token in sequence[3:]:
        assert fork.accept(token)
    assert fork.is_terminated() and not matcher.is_terminated() and matcher.num_accepted == 3
    fork.rollback(3)  # a fork keeps the history it was forked with


def test_draft_masks_equal_stepwise_masks_and_leave_state_unchanged(compiler, sequence):
    vocab = compiler.vocab_size
    k = 2
    draft = sequence[k : k + 5]
    reference = compiler.matcher({"json_schema": SCHEMA})
    expected = _masks_along(reference, sequence[: k + len(draft)], vocab)[k:] + [_mask(reference, vocab)]

    matcher = compiler.matcher({"json_schema": SCHEMA})
    for token in sequence[:k]:
        matcher.accept(token)
    before = _mask(matcher, vocab)
    bitmask = allocate_token_bitmask(len(draft) + 3, vocab)
    assert matcher.fill_draft_bitmasks(draft, bitmask, first_row=2) == len(draft)
    for i, mask in enumerate(expected):
        assert torch.equal(bitmask[2 + i], mask), f"row {i}"
    assert matcher.num_accepted == k and torch.equal(_mask(matcher, vocab), before)

    # Verification kept 3 draft tokens; the engine accepts them and then the bonus token.
    for token in draft[:3]:
        assert matcher.accept(token)
    assert torch.equal(_mask(matcher, vocab), expected[3])


def test_draft_stops_at_the_first_ungrammatical_token(compiler, tokenizer, sequence):
    vocab = compiler.vocab_size
    matcher = compiler.matcher({"json_schema": SCHEMA})
    first = _mask(matcher, vocab)
    second = _masks_along(compiler.matcher({"json_schema": SCHEMA}), sequence[:2], vocab)[1]
    bad = next(t for t in range(len(tokenizer)) if not token_allowed(second[None], 0, t))
    draft = [sequence[0], bad, sequence[2], sequence[3]]
    bitmask = allocate_token_bitmask(len(draft) + 1, vocab)
    bitmask.zero_()
    assert matcher.fill_draft_bitmasks(draft, bitmask, 0) == 1
    assert torch.equal(bitmask[0], first)
    assert not token_allowed(bitmask, 1, bad)
    assert bool((bitmask[2:] == -1).all()), "rows past the rejection are unused and left finite"
    assert matcher.num_accepted == 0


def test_batch_draft_masks_mix_free_and_constrained(compiler, sequence):
    vocab = compiler.vocab_size
    drafts = [sequence[:3], [5, 6], sequence[:1]]
    matchers = [compiler.matcher({"json_schema": SCHEMA}), None, compiler.matcher({"json_schema": SCHEMA})]
    bitmask = allocate_token_bitmask(sum(len(d) + 1 for d in drafts), vocab)
    bitmask.zero_()
    assert fill_draft_token_bitmask(matchers, drafts, bitmask) == [3, 2, 1]
    assert bool((bitmask[4:7] == -1).all())
    assert torch.equal(bitmask[0], bitmask[7]), "both constrained requests start from the grammar's first mask"
    with pytest.raises(ValueError, match="the drafts need 9"):
        fill_draft_token_bitmask(matchers, drafts, bitmask[:8])
