"""FP8 Engram tables under expert parallelism on 2 gloo ranks: each rank loads its row shard of the table and of
its scales (the block read off the whole table's scale grid), and the engine equals one process (fp32); host and
device placement of the shards give the same logits bit for bit."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM
from deepinfer.models import load_model, read_model_config
from deepinfer.ops import OpTable
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.plan import ParallelConfig, plan_parallel
from tests.support.engine_checks import assert_same_output, mixed_params, ragged_prompts
from tests.support.engram_placement import ElsewhereBackend
from tests.support.model_runs import run_chunked
from tests.support.quantized import V41_RELEASED, quantize_checkpoint, v41_released_layout
from tests.support.ranks import results, run_ranks
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)
from tests.support.v41_fixtures import FIXTURES

COMMON = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=24, state_cache_bytes=1 << 22)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """tiny_b with FP8 Engram tables (1362 rows, ue8m0 scales per 32 columns) and MXFP4 experts, as released."""
    target = tmp_path_factory.mktemp("released_ep")
    return str(quantize_checkpoint(FIXTURES / "tiny_b", target, v41_released_layout,
                                   quantization_config=V41_RELEASED)[0])


def _serve(rank, world, path, prompts, params):
    llm = LLM(path, **COMMON, data_parallel_size=2, expert_parallel_size=2)
    tables = [layer.engram.weights for layer in llm.engine.model.layers if layer.engram is not None]
    shards = [(w.table.dtype, tuple(w.table.shape), tuple(w.table_scale.shape)) for w in tables]
    return llm.generate(prompts, params, use_tqdm=False), shards


def test_expert_parallel_loads_fp8_engram_shards_and_equals_one_process(released):
    prompts = ragged_prompts(read_model_config(released).vocab_size, count=4, max_len=30, seed=5)
    params = mixed_params(max_tokens=4)[:4]
    expected = LLM(released, **COMMON).generate(prompts, params, use_tqdm=False)
    for outs, shards in results(run_ranks(_serve, 2, released, prompts, params), 2):
        assert shards == [(torch.float8_e4m3fn, (681, 32), (681, 1))]  # half the rows, and their scales
        for a, b in zip(outs, expected, strict=True):
            assert_same_output(a, b)


def _placements(rank, world, path):
    cfg = read_model_config(path)
    logits = {}
    for placement in ("host", "device"):
        plan = plan_parallel(ParallelConfig(2, 2), world, rank, n_routed_experts=cfg.n_routed_experts,
                             num_moe_layers=cfg.num_hidden_layers)
        backend = ElsewhereBackend()
        model = load_model(path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"),
                           parallel=ParallelContext.create(plan, 60.0), engram_placement=placement, backend=backend)
        assert len(backend.placed) == (2 if placement == "host" else 0)  # the shard's rows and scales
        tokens = torch.randint(3, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(rank))
        logits[placement] = run_chunked(model, tokens, 11)
    return torch.equal(logits["host"], logits["device"])


def test_expert_parallel_host_and_device_shards_give_the_same_logits_bit_for_bit(released):
    assert results(run_ranks(_placements, 2, released), 2) == [True, True]
