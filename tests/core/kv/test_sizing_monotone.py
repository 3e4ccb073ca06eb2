"""State-pool sizing is monotone in the budget (more bytes never give fewer slots or admit fewer bytes), and every
budget an error message names works."""

from __future__ import annotations

import re

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.llm import load_tokenizer
from deepinfer.kv.sizing import min_pool_bytes, plan_pool, pool_bytes_for
from deepinfer.models import load_model
from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING
from deepinfer.models.deepseek_v4.state import state_spec
from deepinfer.ops import OpTable
from tests.support.tiny_assets import TINY_V41_DIR

V4_SPEC = state_spec(window=16, head_dim=32, index_head_dim=16, kinds=(SLIDING, CSA, HCA, CSA), ratios=(0, 4, 16, 4),
                     page_size=4)


@pytest.fixture(scope="module")
def v41_model():
    from deepinfer.backends.cpu import CpuBackend

    return load_model(TINY_V41_DIR, ops=OpTable.for_backend(CpuBackend()), dtype=torch.float32,
                      device=torch.device("cpu"))


def _assert_monotone(spec, size: int, max_seqs: int, capacities: range) -> None:
    last = None
    for capacity in capacities:
        try:
            plan = plan_pool(spec, size, max_seqs, capacity)
        except ValueError:
            assert last is None, f"{capacity} bytes refused after a smaller budget was accepted"
            continue
        assert plan.nbytes <= capacity
        if last is not None:
            assert plan.slots >= last.slots and plan.admissible >= last.admissible, \
                f"{capacity} bytes: {plan.slots - 1} slots admit {plan.admissible} B, less than a smaller budget's " \
                f"{last.slots - 1} slots and {last.admissible} B"
        last = plan


@pytest.mark.parametrize("max_seqs", [1, 3, 256])
def test_v4_sizing_is_monotone(max_seqs):
    _assert_monotone(V4_SPEC, 4, max_seqs, range(1_000, 400_000, 1_499))


def test_embedded_v41_sizing_is_monotone(v41_model):
    spec, size = v41_model.state_spec, 4
    _assert_monotone(spec, size, 256, range(150_000, 2_500_000, 7_001))
    # the budgets the probe found (560,000 B admitted more than 640,000 B)
    assert plan_pool(spec, size, 256, 640_000).admissible >= plan_pool(spec, size, 256, 560_000).admissible


def test_named_budgets_work(v41_model):
    spec, size = v41_model.state_spec, 4
    least = min_pool_bytes(spec, size, 256)
    assert plan_pool(spec, size, 256, least).admissible >= spec.state_bytes(2, size)
    with pytest.raises(ValueError, match=f"at least {least}"):
        plan_pool(spec, size, 256, least - 1)
    for tokens in (40, 300, 2_000):
        one = pool_bytes_for(spec, size, 256, tokens, sequences=1)
        assert plan_pool(spec, size, 256, one).admissible >= spec.state_bytes(tokens, size)


@pytest.mark.parametrize("loaded", [False, True], ids=["checkpoint (memory plan)", "from_model (sizing)"])
def test_engine_names_a_state_budget_that_fits_max_model_len(v41_model, loaded):
    def build(budget: int) -> LLM:
        limits = dict(max_num_seqs=8, state_cache_bytes=budget, max_model_len=500)
        if loaded:
            return LLM.from_model(v41_model, load_tokenizer(TINY_V41_DIR), **limits)
        return LLM(str(TINY_V41_DIR), dtype="float32", **limits)

    with pytest.raises(ValueError, match=r"raise state_cache_bytes to at least (\d+)") as info:
        build(min_pool_bytes(v41_model.state_spec, 4, 8))
    llm = build(int(re.search(r"at least (\d+)", str(info.value)).group(1)))
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 3
