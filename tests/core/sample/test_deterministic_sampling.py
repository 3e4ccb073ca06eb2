"""Deterministic sampling: with ``DEEPINFER_BATCH_INVARIANT=1`` (and MTP varlen off), a request with
``SamplingParams(seq_seed=...)`` draws the same tokens in any batch, any run and any process.

Its logits are bitwise batch-invariant (test_batch_invariance.py) and its noise is a pure function of
(seed, output position, token id) (ops/sampling.py), so nothing else can reach its draw.  On a tiny random
V4 checkpoint: 1000 sampled runs of one request in shifting batches give one output; a fresh process with
another thread count gives the same; different seeds give different outputs.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from deepinfer import LLM, SamplingParams
from tests.support.engine_checks import ragged_prompts
from tests.support.v4_fixtures import SMALL, build_engine_checkpoint, single_thread  # noqa: F401

FLAGS = {"DEEPINFER_BATCH_INVARIANT": "1", "DEEPINFER_ENABLE_MTP_VARLEN": "0"}
VOCAB = 400
PROMPT = ragged_prompts(VOCAB, lengths=[21], seed=5)[0]
RUNS = 1000
MAX_TOKENS = 4


def _params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, seq_seed=seed, max_tokens=MAX_TOKENS, logprobs=0,
                          ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory, _ = build_engine_checkpoint(tmp_path_factory.mktemp("tiny_v4_det"), SMALL, vocab_size=VOCAB)
    return directory


@pytest.fixture
def flags(monkeypatch):
    for name, value in FLAGS.items():
        monkeypatch.setenv(name, value)


def _llm(checkpoint, **limits) -> LLM:
    return LLM(str(checkpoint), dtype="float32", **limits)


def _signature(out) -> tuple:
    """Tokens and the (bitwise) cumulative logprob of a request's completion."""
    completion = out.outputs[0]
    return tuple(completion.token_ids), completion.cumulative_logprob


@pytest.fixture(scope="module")
def alone(checkpoint):
    with pytest.MonkeyPatch.context() as mp:
        for name, value in FLAGS.items():
            mp.setenv(name, value)
        return _signature(_llm(checkpoint).generate([PROMPT], _params(2024), use_tqdm=False)[0])


def test_1000_sampled_runs_in_shifting_batches_give_one_output(checkpoint, flags, alone):
    """The request is repeated among neighbours of random lengths, temperatures, seeds and output lengths, at
    every place in the batch, under two schedulers (different batch and chunk limits)."""
    rng = random.Random(0)
    seen: list[tuple] = []
    schedulers = (dict(max_num_seqs=256, max_num_batched_tokens=2048),
                  dict(max_num_seqs=97, max_num_batched_tokens=300))
    for limits in schedulers:
        llm = _llm(checkpoint, **limits)
        for call in range(2):
            others = ragged_prompts(VOCAB, count=RUNS // 4, max_len=40, seed=100 + len(seen) + call)
            prompts, params, needles = [], [], []
            for other in others:
                if rng.random() < 0.5:
                    prompts.append(other)
                    params.append(SamplingParams(temperature=rng.choice([0.0, 0.7, 1.2]), seed=rng.randrange(10**6),
                                                 max_tokens=rng.randint(1, 6), ignore_eos=True))
                needles.append(len(prompts))
                prompts.append(PROMPT)
                params.append(_params(2024))
            outs = llm.generate(prompts, params, use_tqdm=False)
            seen += [_signature(outs[i]) for i in needles]
    assert len(seen) == RUNS
    assert set(seen) == {alone}, f"{len(set(seen))} distinct outputs"


_CHILD = """
import json, sys
from deepinfer import LLM, SamplingParams
params = SamplingParams(**json.loads(sys.argv[2]))
out = LLM(sys.argv[1], dtype="float32").generate([json.loads(sys.argv[3])], params, use_tqdm=False)[0].outputs[0]
print(json.dumps([out.token_ids, out.cumulative_logprob]))
"""


def test_another_process_draws_the_same(checkpoint, alone):
    """A fresh interpreter at torch's default thread count (this one runs on one thread)."""
    p = _params(2024)
    fields = dict(temperature=p.temperature, top_p=p.top_p, seq_seed=p.seq_seed, max_tokens=p.max_tokens,
                  logprobs=p.logprobs, ignore_eos=p.ignore_eos)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | FLAGS
    done = subprocess.run([sys.executable, "-c", _CHILD, str(checkpoint), json.dumps(fields), json.dumps(PROMPT)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    tokens, cumulative = json.loads(done.stdout.strip().splitlines()[-1])
    assert (tuple(tokens), cumulative) == alone


def test_different_seeds_draw_differently(checkpoint, flags, alone):
    seeds = list(range(100))
    outs = _llm(checkpoint).generate([PROMPT] * len(seeds), [_params(s) for s in seeds], use_tqdm=False)
    distinct = {tuple(o.outputs[0].token_ids) for o in outs}
    assert len(distinct) >= 90, f"only {len(distinct)} distinct outputs from {len(seeds)} seeds"
    first = {tuple(o.outputs[0].token_ids)[0] for o in outs}
    assert len(first) >= 10  # the first token alone already varies with the seed


def test_batch_invariance_with_mtp_varlen_fails_at_start_up(checkpoint, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    with pytest.raises(ValueError, match="batch-wide budget.*set DEEPINFER_ENABLE_MTP_VARLEN=0"):
        _llm(checkpoint)
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    assert _llm(checkpoint).engine is not None
