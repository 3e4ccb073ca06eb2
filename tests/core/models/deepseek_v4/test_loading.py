"""Loading DeepSeek-V4 checkpoints: released names with or without a ``model.`` prefix, sharded files,
MTP tensors kept aside, and precise errors for missing / unexpected / mis-shaped tensors.  No pickles."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.models import CheckpointError, load_model
from deepinfer.ops import OpTable
from tests.support.model_runs import run_chunked
from tests.support.v4_fixtures import (  # noqa: F401  (single_thread is an autouse fixture)
    SMALL,
    build_checkpoint,
    random_tokens,
    read_tensors,
    single_thread,
    write_checkpoint,
)

RELEASED_TOP_LEVEL = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
                      "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path, _ = build_checkpoint(tmp_path_factory.mktemp("v4"), SMALL, seed=5)
    config = json.loads((path / "config.json").read_text())
    return path, read_tensors(path), config


def _load(path, dtype=torch.float32):
    return load_model(path, ops=OpTable(), dtype=dtype, device=torch.device("cpu"))


def _logprobs(path):
    return run_chunked(_load(path), random_tokens(40, SMALL["vocab_size"], seed=1), 40)


def test_names_as_released_and_sharded_load_the_same_model(saved, tmp_path):
    path, tensors, config = saved
    expected = _logprobs(path)
    # As in DeepSeek's own files: no `model.` prefix, `embed.weight`, `hc_head_fn`, ...
    released = {RELEASED_TOP_LEVEL.get(k, k).removeprefix("model."): v for k, v in tensors.items()}
    assert "embed.weight" in released and "layers.0.attn.wq_a.weight" in released
    torch.testing.assert_close(_logprobs(write_checkpoint(tmp_path / "released", released, config)), expected)

    shards = tmp_path / "sharded"
    shards.mkdir()
    names = sorted(released)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: released[n] for n in part}, str(shards / file))
        weight_map.update(dict.fromkeys(part, file))
    (shards / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (shards / "config.json").write_text(json.dumps(config))
    torch.testing.assert_close(_logprobs(shards), expected)


def test_mtp_tensors_are_kept(saved, tmp_path, monkeypatch):
    """In the weight mode of the rest: dequantized at load (default on the reference ops), or as stored."""
    path, tensors, config = saved
    mtp = {"mtp.0.e_proj.weight": torch.randn(64, 64), "mtp.0.enorm.weight": torch.ones(64),
           "mtp.0.attn.wq_a.weight": torch.randn(32, 64).to(torch.float8_e4m3fn),
           "mtp.0.attn.wq_a.scale": torch.ones(1, 1, dtype=torch.float8_e8m0fnu)}
    path = write_checkpoint(tmp_path / "mtp", {**tensors, **mtp}, config)
    model = _load(path)
    assert set(model.mtp_weights) == {"mtp.0.e_proj.weight", "mtp.0.enorm.weight", "mtp.0.attn.wq_a.weight"}
    torch.testing.assert_close(model.mtp_weights["mtp.0.e_proj.weight"], mtp["mtp.0.e_proj.weight"])
    torch.testing.assert_close(model.mtp_weights["mtp.0.attn.wq_a.weight"], mtp["mtp.0.attn.wq_a.weight"].float())
    monkeypatch.setenv("DEEPINFER_QUANTIZED_WEIGHTS", "native")
    quantized = _load(path).mtp_weights["mtp.0.attn.wq_a.weight"]
    assert quantized.format == "fp8_block" and quantized.data.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize(
    "edit, messages",
    [
        (lambda t: t.pop("model.layers.1.attn.wkv.weight"),
         ["layers.1.attn.wkv.weight: missing (expected shape (32, 64))"]),
        (lambda t: t.update({"model.layers.0.attn.wkv.weight": torch.zeros(32, 65)}),
         ["layers.0.attn.wkv.weight: expected shape (32, 64), checkpoint has (32, 65)"]),
        (lambda t: t.update({"model.layers.9.attn.wkv.weight": torch.zeros(3)}),
         ["layers.9.attn.wkv.weight: unexpected tensor of shape (3,)"]),
        (lambda t: t.update({"model.layers.2.ffn.experts.8.w1.weight": torch.zeros(32, 64),
                             "model.layers.0.attn.compressor.ape": torch.zeros(4, 32)}),
         ["layers.2.ffn.experts.8.w1.weight: unexpected", "layers.0.attn.compressor.ape: expected shape (4, 64)"]),
        (lambda t: t.update({"layers.0.attn.wkv.weight": torch.zeros(32, 64)}),
         ["layers.0.attn.wkv.weight: stored twice"]),
        (lambda t: t.update({"model.layers.0.attn.wq_a.weight": torch.zeros(32, 64).to(torch.float8_e4m3fn),
                             "model.layers.0.attn.wq_a.scale": torch.ones(2, 2)}),
         ["layers.0.attn.wq_a.weight: FP8 dense projection of dense shape (32, 64) stored as data (32, 64) with "
          "scales (2, 2); the role needs data (32, 64) and scales (1, 1) (128x128 blocks)"]),
    ],
    ids=["missing", "misshaped", "unexpected", "several", "twice", "scale-shape"],
)
def test_mismatches_are_reported_by_name_and_shape(saved, tmp_path, edit, messages):
    _, tensors, config = saved
    tensors = dict(tensors)
    edit(tensors)
    with pytest.raises(CheckpointError) as err:
        _load(write_checkpoint(tmp_path / "bad", tensors, config))
    for message in messages:
        assert message in str(err.value)


def test_pickled_checkpoints_are_refused_unopened(saved, tmp_path, monkeypatch):
    _, _, config = saved
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    with pytest.raises(CheckpointError, match="safetensors only.*pytorch_model.bin"):
        _load(tmp_path)


def test_loaded_dtypes(saved):
    path, _, _ = saved
    model = _load(path, dtype=torch.bfloat16)
    attn = model.layers[0].attn
    assert [w.dtype for w in attn.w_in.weights] == [torch.bfloat16] and model.embed.dtype == torch.bfloat16
    # mHC, sinks, position biases, router bias and norms stay fp32, as in the reference
    assert attn.sinks.dtype == attn.q_norm.dtype == attn.compressor.position_bias.dtype == torch.float32
    assert model.layers[0].attn_hc.fn.dtype == model.layers[2].ffn.bias.dtype == torch.float32
    assert model.layers[0].ffn.tid2eid.dtype == torch.int64


def test_bfloat16_model_tracks_fp32(saved):
    """bf16 compute drifts (top-k picks can flip), but the distribution stays close on average."""
    path, _, _ = saved
    tokens = random_tokens(60, SMALL["vocab_size"], seed=2)
    fp32 = run_chunked(_load(path), tokens, 60)
    bf16 = run_chunked(_load(path, torch.bfloat16), tokens, 7)
    assert torch.isfinite(bf16).all()
    total_variation = 0.5 * (fp32.exp() - bf16.exp()).abs().sum(-1)
    assert total_variation.mean() < 0.05, total_variation.mean()
    assert (fp32.argmax(-1) == bf16.argmax(-1)).float().mean() >= 0.9
