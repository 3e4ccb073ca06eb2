"""The memory plan (``engine/memory_plan.py``) against what the model really holds: the real-dims V4.1-Flash built by
the real loader on the meta device (nothing allocated), the synthetic released checkpoint built on the CPU in both
weight modes (with its drafter and state pool), and each expert-parallel rank's share as the loader selects it.

Every role's planned bytes are the bytes the model holds in that role, exactly, and the model holds nothing the
plan does not count (no second copy of a weight, ``tests/support/held_bytes.py``'s ``UNPLANNED``).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import weight_roles as wr
from deepinfer.engine.memory_plan import GiB, MemoryPlanError, MemoryPlanner, PlanRequest
from deepinfer.engine.plan_fit import check_fits
from deepinfer.engine.plan_inputs import PlanInputs, read_plan_inputs
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.released_layout import released_layout
from deepinfer.testing.released_checkpoint import (
    RELEASED_TEXT_CONFIG,
    released_config,
    write_released_checkpoint,
    write_released_config,
)
from tests.support.held_bytes import BUFFERS, DRAFTER_CONTEXT, STATE_POOL, UNPLANNED, MetaCheckpoint, held_by_role
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)

#: V4.1-Flash's per-layer dims and tables on 6 layers: every role (SWA + Engram, ratio-2 Full / Reindex, ratio-1
#: Full (candidate source) / Reindex, both Engram tables at their real sizes, 384 experts, 3 DSpark stages).
REAL_SLICE = {**RELEASED_TEXT_CONFIG, "num_hidden_layers": 6, "compress_ratios": [0, 0, 2, 2, 1, 1, 0, 0, 0],
              "kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 3, 4, 5], "candidate_source_layer_id": 4,
              "engram_layer_ids": [1, 3], "dspark_target_layer_ids": [3, 4, 5]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_released_checkpoint(tmp_path_factory.mktemp("released") / "v41")


def _request(**fields) -> PlanRequest:
    return PlanRequest(engram="device", speculative=True, **fields)


def _roles(plan) -> dict[str, int]:
    return {r.role: r.device + r.host for r in plan.roles}


def _check_roles(held: dict[str, int], plan) -> None:
    """Each role holds what the plan says, and nothing is held beyond the plan."""
    planned = _roles(plan)
    assert {role: held.get(role, 0) for role in wr.ROLES} == planned
    assert UNPLANNED not in held and planned[wr.IGNORED] == 0


def _meta_model(text_config, monkeypatch):
    """The real loader and model over headers served as meta tensors (value checks skipped: no values)."""
    from deepinfer.models import weight_reader
    from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from deepinfer.models.deepseek_v41.weights import read_weights
    from deepinfer.ops import OpTable

    monkeypatch.setattr(weight_reader, "check_finite", lambda *args, **kwargs: None)
    monkeypatch.setattr(weight_reader, "scale_values", lambda scale: scale)
    monkeypatch.setenv("DEEPINFER_QUANTIZED_WEIGHTS", "native")
    cfg = DeepseekV41Config.from_dict(released_config(text_config))
    layout = released_layout(cfg)
    tensors, mtp = read_weights(MetaCheckpoint(layout), cfg, torch.bfloat16, torch.device("meta"))  # type: ignore[arg-type]
    model = DeepseekV41ForCausalLM(cfg, tensors, mtp, torch.zeros(cfg.vocab_size, dtype=torch.int64), ops=OpTable(),
                                   dtype=torch.bfloat16, device=torch.device("cpu"), native_weights=True)
    return model, PlanInputs(cfg, tuple(layout), "meta", None)  # type: ignore[arg-type]


def test_plan_equals_the_real_dims_model_on_meta(monkeypatch):
    """V4.1-Flash's real per-layer dims (6 layers, both real Engram tables, the drafter): the plan's bytes per role
    are the tensors the model built by the real loader holds.  The whole 40-layer model: the slow test below."""
    model, inputs = _meta_model(REAL_SLICE, monkeypatch)
    held = held_by_role(model)
    _check_roles(held, MemoryPlanner(inputs).plan(_request()))
    assert held[wr.ENGRAM_TABLES] > 180 * GiB and held[wr.ROUTED] > 40 * GiB  # the real sizes were built
    assert held[BUFFERS] < 16 << 20  # RoPE frequencies, hash constants, the token map


@pytest.mark.slow  # ~25 s of model building on meta; the 6-layer slice above checks the same rules
def test_plan_equals_the_whole_real_model_on_meta(monkeypatch):
    model, inputs = _meta_model(RELEASED_TEXT_CONFIG, monkeypatch)
    held = held_by_role(model)
    _check_roles(held, MemoryPlanner(inputs).plan(_request()))
    total = sum(held.get(r, 0) for r in wr.ROLES)
    assert 470 * GiB < total < 480 * GiB


@pytest.mark.parametrize("mode", ["native", "dequantize"])
def test_plan_equals_the_tiny_model_with_its_drafter_and_pool(tiny, mode, monkeypatch):
    """The synthetic checkpoint built on the CPU in bf16: weights by role (the drafter's as stored or dense, a
    dequantized shared expert stacked with the routed ones counted as shared), the drafter's context rings and
    the state pool the engine sizes (``state_pool_bytes``: what the plan wants) as planned."""
    from deepinfer.models import load_model
    from deepinfer.ops import OpTable

    monkeypatch.setenv("DEEPINFER_QUANTIZED_WEIGHTS", mode)
    model = load_model(tiny, ops=OpTable(), dtype=torch.bfloat16, device=torch.device("cpu"))
    plan = MemoryPlanner(read_plan_inputs(tiny)).plan(_request(quantized_weights=mode, max_num_seqs=4,
                                                               max_model_len=64))
    model.configure_state(4, plan.state_wanted)
    held = held_by_role(model, model.make_drafter())
    _check_roles(held, plan)
    assert held[DRAFTER_CONTEXT] == plan.drafter_context
    assert plan.state_wanted * 0.99 <= held[STATE_POOL] <= plan.state_wanted


def _loaded_bytes(inputs: PlanInputs, context) -> tuple[int, int]:
    """(routed experts, Engram tables) bytes a rank loads: the loader's own selection (``ParallelContext.loads``,
    ``table_rows``) over the checkpoint's headers, as stored."""
    experts = sum(t.nbytes for t in inputs.tensors if ".ffn.experts." in t.name and t.name.startswith("layers.")
                  and context.loads(t.name))
    tables = 0
    for t in inputs.tensors:
        if ".engram.embed." in t.name:
            rows = context.table_rows(t.name, t.shape[0])
            tables += t.nbytes // t.shape[0] * (rows.stop - rows.start)
    return experts, tables


@pytest.mark.parametrize("dp, ep, redundant", [(2, 2, None), (4, 4, None), (4, 2, None), (4, 4, 4)])
def test_expert_parallel_ranks_hold_what_the_loader_selects(tiny, dp, ep, redundant):
    """Every rank of DP x EP worlds (replicas too): its routed experts and Engram rows as the plan counts them
    equal what the loader would read for that rank (as stored: an expert-parallel layer keeps them so)."""
    from deepinfer.parallel.comm import Communicator
    from deepinfer.parallel.context import ParallelContext
    from deepinfer.parallel.plan import ParallelConfig, plan_parallel

    inputs = read_plan_inputs(tiny)
    request = PlanRequest(data_parallel_size=dp, expert_parallel_size=ep, num_redundant_experts=redundant)
    ranks = MemoryPlanner(inputs).ranks(request)
    config = ParallelConfig(dp, ep, 1, redundant)
    for rank in range(dp):
        plan = plan_parallel(config, dp, rank, n_routed_experts=inputs.config.n_routed_experts,
                             num_moe_layers=inputs.config.num_hidden_layers)
        alone = Communicator.alone()
        context = ParallelContext(plan, alone, Communicator(plan.ep_ranks, rank, 0.0), alone)
        roles = {r.role: r for r in ranks[plan.ep_rank]}
        assert _loaded_bytes(inputs, context) == (roles[wr.ROUTED].device, roles[wr.ENGRAM_TABLES].host)
    whole = {r.role: r for r in MemoryPlanner(inputs).ranks(PlanRequest())[0]}
    assert sum(r.device for r in ranks[0]) < sum(r.device for r in whole.values())


# --- refusals ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """The real model's config.json alone: the plan assumes the released layout."""
    return MemoryPlanner(read_plan_inputs(write_released_config(tmp_path_factory.mktemp("real"))))


def test_one_h200_is_refused_naming_the_experts_and_a_fit(released):
    plan = released.plan(PlanRequest(gpu_memory=139 * GiB))
    with pytest.raises(MemoryPlanError) as info:
        check_fits(plan, released)
    message = str(info.value)
    assert "does not fit 1 x 139.0 GiB" in message and "routed experts 268.9 GiB" in message
    fit = "a configuration that fits: data_parallel_size=4, expert_parallel_size=4, Engram tables in host memory"
    assert fit in message


def test_dequantized_weights_are_refused_with_native_as_the_fit(released):
    plan = released.plan(PlanRequest(data_parallel_size=8, expert_parallel_size=8, gpu_memory=139 * GiB,
                                     quantized_weights="dequantize"))
    with pytest.raises(MemoryPlanError, match=r"routed experts 126\.6 GiB.*a configuration that fits: "
                                              r"data_parallel_size=8, expert_parallel_size=8, .*weights native"):
        check_fits(plan, released)


def test_device_engram_on_four_and_host_engram_on_eight(released):
    four = released.plan(PlanRequest(data_parallel_size=4, expert_parallel_size=4, engram="device",
                                     gpu_memory=139 * GiB))
    eight = released.plan(PlanRequest(data_parallel_size=8, expert_parallel_size=8, gpu_memory=139 * GiB))
    one = released.plan(PlanRequest())
    tables, experts = one.role(wr.ENGRAM_TABLES), one.role(wr.ROUTED)
    assert four.role(wr.ENGRAM_TABLES).device == pytest.approx(tables.host / 4, rel=1e-6)
    assert eight.role(wr.ENGRAM_TABLES).host == pytest.approx(tables.host / 8, rel=1e-6)
    assert eight.role(wr.ROUTED).device * 8 == experts.device and eight.role(wr.DRAFTER).device == 0
    assert eight.problem() is None and eight.weights_device < 45 * GiB


def test_room_for_the_workspace_and_state_is_checked(tiny):
    planner = MemoryPlanner(read_plan_inputs(tiny))
    plan = planner.plan(PlanRequest(gpu_memory=512 << 20))
    assert plan.weights_device < 8 << 20
    with pytest.raises(MemoryPlanError, match=r"MiB of weights, .* remain; the workspace \(~1\.0 GiB\) and the "
                                              r"smallest state pool .* need more; no configuration"):
        check_fits(plan, planner)
    tight = planner.plan(PlanRequest(gpu_memory=3 * GiB // 2, gpu_memory_utilization=1.0))
    assert "gpu_memory_utilization=1.0 gives the state pool 783.5 MiB" in (tight.problem() or "")
    most = float((tight.problem() or "").rsplit("lower it to ", 1)[1].split()[0])
    assert planner.plan(PlanRequest(gpu_memory=3 * GiB // 2, gpu_memory_utilization=most)).problem() is None


def test_bad_requests_name_the_argument(tiny):
    planner = MemoryPlanner(read_plan_inputs(tiny))
    with pytest.raises(ValueError, match="engram must be 'host' or 'device'"):
        PlanRequest(engram="disk")
    with pytest.raises(ValueError, match=r"expert_parallel_size \(3\) must divide the world size"):
        planner.plan(PlanRequest(data_parallel_size=4, expert_parallel_size=3))


# --- deepinfer plan, and LLM's plan -----------------------------------------------------------------------------
def test_cli_prints_the_table_and_refuses_with_status_one(released, capsys):
    from deepinfer.entrypoints.cli import main

    path = str(released.inputs.path)
    main(["plan", path, "--gpus", "8", "--gpu-memory", "139", "--quantized-weights", "native"])
    out = capsys.readouterr().out
    assert "| routed experts " in out and "data parallel 8 x context parallel 1, expert parallel 8" in out
    assert "no shard headers: the released layout assumed" in out and "fits 139.0 GiB a device" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", path, "--gpu-memory", "139", "--quantized-weights", "native"])
    assert exit_info.value.code == 1
    assert "refused: the model in" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--gpus 8, but data_parallel_size x context_parallel_size = 2 ranks"):
        main(["plan", path, "--gpus", "8", "--data-parallel-size", "2"])
    with pytest.raises(SystemExit, match="max_num_seqs must be"):
        main(["plan", path, "--max-num-seqs", "0"])


def test_llm_logs_the_plan_and_refuses_before_reading_weights(tiny, monkeypatch, caplog):
    import logging

    from deepinfer.backends.cpu import CpuBackend
    from deepinfer.engine import llm as llm_module

    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        llm = llm_module.LLM(tiny, dtype="float32", max_num_seqs=2, max_model_len=64)
    line = next(r.message for r in caplog.records if r.message.startswith("memory plan per rank"))
    assert "fits" in line and "in host memory" in line  # the CPU backend reports the host's memory
    assert llm.generate([[5, 6, 7]])[0].outputs

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(llm_module, "load_model", no_weights)
    monkeypatch.setattr(CpuBackend, "memory_info", lambda self, device: (2 << 20, 2 << 20), raising=False)
    with pytest.raises(MemoryPlanError, match=r"the model in .* does not fit 1 x 2\.0 MiB .* weights on its device"):
        llm_module.LLM(tiny, dtype="float32")
    monkeypatch.undo()  # weights fit, the workspace estimate does not: a warning, and the engine runs
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    monkeypatch.setattr(CpuBackend, "memory_info", lambda self, device: (64 << 20, 64 << 20), raising=False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        llm_module.LLM(tiny, dtype="float32", max_num_seqs=2, max_model_len=64)
    assert any(r.levelname == "WARNING" and "may not fit: after" in r.message and "the workspace (~1.1 GiB)"
               in r.message for r in caplog.records)


def test_a_hub_repo_is_planned_from_its_headers_without_its_weights(tiny, tmp_path, monkeypatch):
    """The JSON files come from the (offline) HF cache; the shard headers from ``get_safetensors_metadata``."""
    import huggingface_hub
    from huggingface_hub import constants

    from deepinfer.engine.plan_inputs import hub_plan_inputs
    from tests.support.hf_cache import add_snapshot, commit_hash

    cache = tmp_path / "hub"
    jsons = tmp_path / "jsons"
    jsons.mkdir()
    for file in tiny.glob("*.json"):
        (jsons / file.name).write_bytes(file.read_bytes())
    add_snapshot(cache, "org/released", commit_hash("r"), jsons, ("main",))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    local = read_plan_inputs(tiny)

    class Meta:  # what the hub answers: per file, its tensors' dtypes and shapes
        files_metadata = {"model-00001-of-00001.safetensors": type("File", (), {"tensors": {
            t.name: type("Info", (), {"dtype": t.dtype, "shape": list(t.shape)})() for t in local.tensors}})()}

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", lambda repo, revision=None: Meta())
    remote = hub_plan_inputs("org/released")
    assert set(remote.tensors) == set(local.tensors) and "read from the hub" in remote.source

    def offline(repo, revision=None):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", offline)
    assumed = hub_plan_inputs("org/released")
    assert "the released layout assumed" in assumed.source
    assert {t.name for t in assumed.tensors} == {t.name for t in local.tensors if not t.name.startswith(
        ("vision.", "aligner.", "image_"))}
    with pytest.raises(ValueError, match="could not read 'org/absent''s config.json"):
        hub_plan_inputs("org/absent")
