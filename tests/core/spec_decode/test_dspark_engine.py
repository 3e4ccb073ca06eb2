"""The engine with the real DSpark drafter (branch dspark-model; skipped until it is merged): a V4.1 fixture with a
random ``mtp.*`` drafter decodes greedily exactly as without speculation, with every draft verified and with
confidence-scheduled verification; features reach the drafter (it accepts some drafts)."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.spec_decode.budget import CostTable, SpecPolicy
from tests.support.engine_checks import assert_same_output, ragged_prompts
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)
from tests.support.v41_fixtures import FIXTURES

dspark = pytest.importorskip("deepinfer.models.deepseek_v41.dspark")
dd = pytest.importorskip("tools.train.dspark_dense")

STEEP = CostTable(tuple(range(1, 257)), tuple(1.0 + 0.08 * n for n in range(1, 257)))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    spec = dd.DSparkSpec(num_layers=2, block_size=4, noise_token_id=383, target_layer_ids=[3, 6, 8],
                         markov_rank=16, n_routed_experts=4, num_experts_per_tok=2)
    folder = tmp_path_factory.mktemp("dspark") / "tiny_b_dspark"
    dd.write_drafter_checkpoint(folder, FIXTURES / "tiny_b", spec, 0)
    return LLM(str(folder), dtype="float32")


def _drafter(llm):
    model = llm.engine.model
    if hasattr(model, "make_drafter"):
        return model.make_drafter()
    return dspark.DSparkDrafter.from_model(model, model.pool.slots)


@pytest.mark.parametrize("k,varlen", [(4, False), (2, False), (4, True)])
def test_greedy_output_with_the_dspark_drafter_is_the_plain_output(llm, k, varlen):
    llm.engine.set_drafter(None)
    prompts = ragged_prompts(llm.engine.model.vocab_size, lengths=[9, 14, 21, 30])
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2, repetition_penalty=1.2)]
    plain = llm.generate(prompts, params * 2, use_tqdm=False)
    llm.engine.set_drafter(_drafter(llm), SpecPolicy(k, varlen, STEEP if varlen else None))
    try:
        spec = llm.generate(prompts, params * 2, use_tqdm=False)
    finally:
        llm.engine.set_drafter(None)
    for a, b in zip(plain, spec, strict=True):
        assert_same_output(a, b, tol=2e-2)
    stats = [o.spec_decoding_stats for o in spec]
    assert all(s is not None and s.num_drafts > 0 for s in stats)
    assert sum(s.num_accepted_tokens for s in stats) > 0  # a random drafter still guesses some


def test_the_embedded_v41_drafter_through_the_engine():
    """The embedded tiny V4.1 with its trained drafter: greedy output equals plain decoding and most drafts are
    accepted (offline its mean acceptance length is 4.45 of 5)."""
    from pathlib import Path

    import deepinfer

    path = Path(deepinfer.__file__).parent / "assets" / "tiny_v41"
    if not (path / "config.json").exists():
        pytest.skip("no embedded tiny V4.1 in this tree")
    llm = LLM(str(path), dtype="float32")
    drafter = llm.engine.drafter or _drafter(llm)
    prompts = ["Once upon a time", "One day, a boy"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)
    llm.engine.set_drafter(None)
    plain = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.set_drafter(drafter, SpecPolicy(min(4, drafter.max_draft_len)))
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec, strict=True):
        assert_same_output(a, b, tol=2e-2)
        assert b.spec_decoding_stats.mean_acceptance_length > 3.0
