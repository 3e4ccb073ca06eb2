"""Grammar masks through the engine's real ``Sampler``: valid output, and seeded output independent of the batch.

The model is replaced by logits that depend only on (request, output position), as a batch-invariant
model's would.  A seeded constrained request must then produce the same tokens alone, in a batch with
free and other constrained requests, and at any position in that batch.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from deepinfer.ops import OpTable
from deepinfer.sample.sampler import Sampler, SamplingRow
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured import GrammarMaskProvider
from tests.support.structured import build_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["a", "bb", "ccc"]}},
    "required": ["id", "tag"],
}
PATTERN = r"[a-z]{2,6}-\d{2}"


@pytest.fixture(scope="module")
def setup():
    tokenizer = build_tokenizer()
    vocab = len(tokenizer) + 3
    provider = GrammarMaskProvider(tokenizer, vocab, [tokenizer.eos_token_id])
    return tokenizer, vocab, provider, Sampler(OpTable(), eos_token_ids=[tokenizer.eos_token_id])


def _logits(request_key: int, step: int, vocab: int) -> torch.Tensor:
    """What a batch-invariant model would return for this request at this position."""
    return 2.0 * torch.randn(vocab, generator=torch.Generator().manual_seed(1000 * request_key + step))


def _run(setup, requests: list[tuple[int, SamplingParams]], max_steps: int = 60) -> list[list[int]]:
    """Decode ``requests`` (key, params) together; returns each one's tokens including the stop token."""
    tokenizer, vocab, provider, sampler = setup
    grammars = [provider.matcher(p.so_args) if p.so_args else None for _, p in requests]
    outputs: list[list[int]] = [[] for _ in requests]
    for step in range(max_steps):
        live = [i for i, g in enumerate(grammars) if g is None or not g.is_terminated()]
        if not live:
            break
        logits = torch.stack([_logits(requests[i][0], step, vocab) for i in live])
        rows = [SamplingRow(requests[i][1], requests[i][1].seq_seed or 0, step, [0], outputs[i]) for i in live]
        bitmask = provider.bitmask_for([grammars[i] for i in live], vocab, torch.device("cpu"))
        for i, token in zip(live, sampler(logits, rows, bitmask).tolist(), strict=True):
            outputs[i].append(token)
            if grammars[i] is not None:
                assert grammars[i].accept(token)
    return outputs


def _text(setup, tokens: list[int]) -> str:
    tokenizer = setup[0]
    assert tokens[-1] == tokenizer.eos_token_id, "a constrained request ends with its stop token"
    return tokenizer.decode(tokens[:-1])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_seeded_constrained_output_is_valid_and_batch_independent(setup, temperature):
    json_req = (1, SamplingParams(temperature=temperature, top_p=0.9, seq_seed=11, so_args={"json_schema": SCHEMA}))
    regex_req = (2, SamplingParams(temperature=temperature, seq_seed=12, so_args={"regex": PATTERN}))
    free_req = (3, SamplingParams(temperature=1.0, seq_seed=13))

    alone_json = _run(setup, [json_req])[0]
    alone_regex = _run(setup, [regex_req])[0]
    jsonschema.validate(json.loads(_text(setup, alone_json)), SCHEMA)
    assert re.fullmatch(PATTERN, _text(setup, alone_regex))

    batched = _run(setup, [free_req, regex_req, json_req])
    reordered = _run(setup, [json_req, free_req, regex_req])
    assert batched[2] == reordered[0] == alone_json
    assert batched[1] == reordered[2] == alone_regex


def test_different_seeds_give_different_valid_outputs(setup):
    texts = set()
    for seed in range(6):
        tokens = _run(setup, [(7, SamplingParams(temperature=1.0, seq_seed=seed, so_args={"regex": PATTERN}))])[0]
        text = _text(setup, tokens)
        assert re.fullmatch(PATTERN, text)
        texts.add(text)
    assert len(texts) >= 4, "the seed, not only the logits, drives a sampled constrained request"
