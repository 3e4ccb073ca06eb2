"""The synthetic checkpoint in the released layout (``deepinfer.testing.released_checkpoint``): its files, names,
dtypes and grids as released, and today's loader on it in both weight modes (the native model computes what the
dequantized one does, in fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from deepinfer.models import load_model
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.released_layout import LayoutOptions, StoredTensor, released_layout
from deepinfer.ops import OpTable
from deepinfer.quant import QuantizedTensor
from deepinfer.testing.released_checkpoint import released_config, write_released_checkpoint
from tests.support.model_runs import run_chunked
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)

GiB = 1 << 30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_released_checkpoint(tmp_path_factory.mktemp("released") / "v41")


def _headers(path) -> dict[str, tuple[str, StoredTensor]]:
    """name -> (shard file, tensor as its header says)."""
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(path / file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                part = f.get_slice(name)
                out[name] = (file, StoredTensor(name, tuple(part.get_shape()), part.get_dtype()))
    assert set(out) == set(weight_map)
    return out


def test_the_real_layout_matches_the_published_sizes():
    """The layout at the real config against the release's published sizes: 96,085 tensors (ours: all but the vision
    tower's), ~475 GiB; Engram tables 183-189 GiB; DSpark ~7.4 GiB; UE8M0 scales ~22 GiB; experts MXFP4 ~260 GiB."""
    from deepinfer.testing.released_checkpoint import RELEASED_TEXT_CONFIG

    layout = released_layout(DeepseekV41Config.from_dict(released_config(RELEASED_TEXT_CONFIG)))

    def gib(keep) -> float:
        return sum(t.nbytes for t in layout if keep(t)) / GiB

    assert 95_500 < len(layout) < 96_085
    assert 473 < gib(lambda t: True) < 475
    assert 183 <= gib(lambda t: ".engram.embed." in t.name) <= 189
    assert 7.3 < gib(lambda t: t.name.startswith("mtp.")) < 7.5
    assert 21.5 < gib(lambda t: t.dtype == "F8_E8M0") < 22.5
    assert 255 < gib(lambda t: t.dtype == "I8") < 262


def test_files_names_dtypes_and_grids_as_released(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41" and config["quantization_config"]["weight_block_size"] == [32, 32]
    assert {"text_config", "vision_config"} <= set(config) and len(config["text_config"]["compress_ratios"]) == 12
    assert (checkpoint / "encoding" / "encoding.py").is_file() and (checkpoint / "encoding" / "tests").is_dir()
    headers = _headers(checkpoint)
    files = sorted({file for file, _ in headers.values()})
    assert files == [f"model-{i:05d}-of-00009.safetensors" for i in range(1, 10)]
    assert {headers[n][0] for n in headers if ".engram.embed." in n} == set(files[-2:])
    assert {headers[n][0] for n in headers if n.startswith("mtp.")} == set(files[-5:-2])
    assert {"mtp.0.main_proj.weight", "mtp.2.confidence_head.proj.weight", "image_newline"} <= set(headers)
    tensor = {n: t for n, (_, t) in headers.items()}
    wq_b, expert, table = "layers.3.attn.wq_b", "layers.3.ffn.experts.5.w2", "layers.4.engram.embed"
    assert (tensor[wq_b + ".weight"].dtype, tensor[wq_b + ".scale"].dtype) == ("F8_E4M3", "F8_E8M0")
    assert tensor[wq_b + ".scale"].shape == (-(-tensor[wq_b + ".weight"].shape[0] // 32), 2)  # 32 x 32 blocks
    assert tensor[expert + ".weight"].dtype == "I8" and tensor[expert + ".weight"].shape == (64, 32)
    assert tensor[expert + ".scale"].shape == (64, 2)  # one per 32 of the 64 columns
    assert tensor[table + ".weight"].shape == (630, 32) and tensor[table + ".scale"].shape == (630, 1)
    assert {tensor[n].dtype for n in tensor if ".hc_" in n or n.endswith("attn_sink")} == {"F32"}
    assert tensor["embed.weight"].dtype == tensor["head.weight"].dtype == "BF16"


def test_mxfp4_is_packed_low_nibble_first():
    from deepinfer.testing.released_checkpoint import as_released

    row = torch.tensor([[0.5, 6.0] + [0.0] * 30])  # e2m1 codes 1 and 7, scale 1
    packed = as_released("layers.0.ffn.experts.0.w1.weight", row, "mxfp4")["layers.0.ffn.experts.0.w1.weight"]
    assert packed.dtype == torch.int8 and int(packed[0, 0]) == 0x71


@pytest.fixture(scope="module")
def both_modes(checkpoint):
    """(the dequantized model, the native one), both in fp32."""
    models = []
    with pytest.MonkeyPatch.context() as mp:
        for mode in ("dequantize", "native"):
            mp.setenv("DEEPINFER_QUANTIZED_WEIGHTS", mode)
            models.append(load_model(checkpoint, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu")))
    return models


def test_native_equals_dequantize_in_fp32(both_modes):
    """The tolerance of ``test_released_format.py``: 1e-5 (measured: 0); whole and in chunks of 13."""
    dequantized, native = both_modes
    assert isinstance(native.layers[3].attn.wq_b, QuantizedTensor) and native.layers[3].ffn.scales is not None
    assert native.layers[1].engram.weights.table.dtype == torch.float8_e4m3fn
    tokens = torch.randint(0, 1058, (40,), generator=torch.Generator().manual_seed(0))
    for chunk in (40, 13):
        want = run_chunked(dequantized, tokens, chunk)
        assert torch.isfinite(want).all()
        torch.testing.assert_close(run_chunked(native, tokens, chunk), want, atol=1e-5, rtol=0)


def test_the_engine_serves_it_with_its_drafter(checkpoint, monkeypatch):
    """``LLM`` on it: vision stubs ignored, ``encoding/`` never run, the three DSpark stages draft (CPU default)."""
    from deepinfer import LLM, SamplingParams

    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    llm = LLM(checkpoint, dtype="float32", max_num_seqs=2, max_model_len=128)
    assert llm.engine.drafter is not None and llm.engine.drafter.max_draft_len == 5
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 6


def test_the_other_confidence_head_spelling_builds_the_drafter(tmp_path):
    path = write_released_checkpoint(tmp_path / "v41", options=LayoutOptions(confidence_proj=False))
    model = load_model(path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    model.configure_state(2, model.state_pool_bytes(2, 64))
    assert model.make_drafter() is not None
