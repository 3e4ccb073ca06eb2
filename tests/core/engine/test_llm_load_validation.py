"""``LLM(...)`` refuses a bad checkpoint when it is built, naming the file and the tensor or field, instead of
failing inside ``generate``; from the hub it logs the commit it loaded, and ``revision=`` pins it."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import save_file

from deepinfer import LLM, SamplingParams
from deepinfer.models import CheckpointError
from tests.support.hf_cache import add_snapshot, commit_hash
from tests.support.v4_fixtures import SMALL, build_engine_checkpoint, read_tensors


@pytest.fixture(scope="module")
def engine_checkpoint(tmp_path_factory):
    path, _ = build_engine_checkpoint(tmp_path_factory.mktemp("engine_ckpt"), SMALL, seed=2)
    return path


def _edited(source, target, tensors=None, files=None):
    shutil.copytree(source, target)
    if tensors:
        stored = read_tensors(target)
        stored.update({name: change(stored[name]) for name, change in tensors.items()})
        save_file({k: v.contiguous() for k, v in stored.items()}, str(target / "model.safetensors"))
    for name, text in (files or {}).items():
        (target / name).write_text(text)
    return target


def _nan_at_0(w: torch.Tensor) -> torch.Tensor:
    w = w.clone()
    w.view(-1)[0] = float("nan")
    return w


@pytest.mark.parametrize(
    "tensors, files, fragments",
    [
        ({"model.layers.0.attn.wkv.weight": lambda w: w.to(torch.int32)}, None,
         ["model.safetensors: layers.0.attn.wkv.weight: expected dtype F32/BF16/F16/F64", "found I32"]),
        ({"model.layers.1.attn.wq_b.weight": _nan_at_0}, None,
         ["layers.1.attn.wq_b.weight (stored as 'model.layers.1.attn.wq_b.weight'): expected finite values",
          "(1 NaN, 0 inf)"]),
        ({"model.layers.1.ffn.gate.tid2eid": lambda t: t - 1}, None,
         ["layers.1.ffn.gate.tid2eid", "expected ids in [0, 8) (n_routed_experts = 8), found values from -1 to 6"]),
        (None, {"generation_config.json": '{"eos_token_id": [1,}'}, ["generation_config.json: invalid JSON"]),
        (None, {"tokenizer_config.json": "[]"}, ["tokenizer_config.json: expected a JSON object"]),
        (None, {"config.json": json.dumps({**SMALL, "model_type": "deepseek_v4", "sliding_window": 0})},
         ["config.json: sliding_window must be an integer >= 1, found 0"]),
    ],
    ids=["int32-weight", "nan-weight", "negative-expert-id", "generation-config", "tokenizer-config", "config-field"],
)
def test_llm_refuses_a_bad_checkpoint_at_construction(engine_checkpoint, tmp_path, tensors, files, fragments):
    path = _edited(engine_checkpoint, tmp_path / "bad", tensors, files)
    with pytest.raises(CheckpointError) as err:
        LLM(str(path), dtype="float32", max_num_seqs=2)
    message = str(err.value)
    assert str(path) in message and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_llm_from_the_hub_logs_the_commit_and_revision_pins_it(engine_checkpoint, tmp_path, monkeypatch, caplog):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    old, new = commit_hash("old"), commit_hash("new")
    add_snapshot(cache, "org/tiny", old, engine_checkpoint, ("v1",))
    add_snapshot(cache, "org/tiny", new, engine_checkpoint, ("main",))
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        llm = LLM("org/tiny", revision="v1", dtype="float32", max_num_seqs=2)
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"org/tiny: using commit {old} (revision 'v1')" in m for m in messages), messages
    assert any(f"(HF hub (org/tiny@{old}))" in m for m in messages), messages
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 3
