"""V4.1 in the released layout (the embedded tiny V4.1 quantized as released: MXFP4 routed and draft experts, FP8
dense projections, shared experts and ``main_proj``, FP8 Engram tables) in both weight modes: the same logprobs,
the bytes each mode holds (``dequantize`` keeps no stored copy beside its dense weights, nor a load two copies of
more than one layer), the DSpark drafter kept as stored and not read at all when speculative decoding is off."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from deepinfer import LLM
from deepinfer.models import load_model
from deepinfer.models.deepseek_v41.dspark import DSparkDrafter
from deepinfer.models.weight_reader import WeightReader
from deepinfer.ops import OpTable
from deepinfer.quant import QuantizedTensor
from tests.support.held_bytes import held_bytes, held_storages
from tests.support.model_runs import run_chunked
from tests.support.quantized import released_tiny_v41
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)

TOKENS = torch.randint(3, 1058, (40,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return released_tiny_v41(tmp_path_factory.mktemp("tiny_v41_released"))


@pytest.fixture
def loads(monkeypatch):
    """Load a checkpoint in a weight mode; ``loads.stored`` holds weak references to the quantized tensors the
    reader produced (data and scales) by name."""

    def load(path, mode: str):
        monkeypatch.setenv("DEEPINFER_QUANTIZED_WEIGHTS", mode)
        load.stored = {}
        return load_model(path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))

    reads = WeightReader.load

    def recorded(self, name, shape, rows=None, device=None):
        tensor = reads(self, name, shape, rows, device)
        if isinstance(tensor, QuantizedTensor):
            load.stored[name] = (weakref.ref(tensor.data), weakref.ref(tensor.scale))
        return tensor

    monkeypatch.setattr(WeightReader, "load", recorded)
    return load


def test_native_equals_dequantize(released, loads):
    """On the reference ops the packed ops dequantize then run the dense op: the same logprobs, bit for bit, and
    the same as the checkpoint saved dequantized (within 1e-5: its Engram tables are read as fp32)."""
    quantized, twin = released
    native = loads(quantized, "native")
    assert native.layers[3].ffn.scales is not None and native.layers[3].ffn.fp8_block is None  # MXFP4 experts
    assert isinstance(native.layers[3].attn.wo_b, QuantizedTensor)
    got = run_chunked(native, TOKENS, 16)
    assert torch.equal(got, run_chunked(loads(quantized, "dequantize"), TOKENS, 16))
    torch.testing.assert_close(got, run_chunked(loads(twin, "dequantize"), TOKENS, 40), atol=1e-5, rtol=0)


def _alive(stored):
    gc.collect()
    return {name for name, refs in stored.items() if any(ref() is not None for ref in refs)}


def test_dequantize_keeps_no_stored_copy(released, loads):
    """``dequantize``: each stored tensor is dropped once dequantized (only the Engram tables, gathered by row,
    stay FP8), and the model holds exactly the twin's bytes but for those tables."""
    quantized, twin = released
    model = loads(quantized, "dequantize")
    assert _alive(loads.stored) == {"layers.1.engram.embed.weight", "layers.4.engram.embed.weight"}
    tables = [layer.engram.weights for layer in model.layers if layer.engram is not None]
    as_stored = sum(t.table.nbytes + t.table_scale.nbytes for t in tables)
    dense = sum(t.table.nbytes for t in (layer.engram.weights for layer in loads(twin, "dequantize").layers
                                         if layer.engram is not None))
    assert held_bytes(model) == held_bytes(loads(twin, "dequantize")) - dense + as_stored


def test_native_keeps_only_what_its_layers_run(released, loads):
    """``native``: every stored tensor still alive is one the model's layers hold (none kept aside), the routed
    experts are the checkpoint's bytes, and the model is smaller than its dequantized load."""
    quantized, _ = released
    model = loads(quantized, "native")
    held = held_storages(model)
    for name in _alive(loads.stored):
        data, scale = loads.stored[name]
        assert data().untyped_storage().data_ptr() in held, f"{name}: alive, but held by no layer"
    moe = model.layers[3].ffn
    assert moe.w13.dtype == torch.int8 and moe.w13.shape == (4, 192, 64)  # w1 | w3 of 4 experts, K/2 bytes a row
    assert held_bytes(model) < held_bytes(loads(quantized, "dequantize"))


@pytest.mark.parametrize("mode", ["native", "dequantize"])
def test_a_layer_s_loaded_tensors_are_released_once_it_is_built(released, loads, monkeypatch, mode):
    """The model consumes what the loader read, layer by layer (its stacks replace the stored parts): when a layer
    is built, no earlier layer's tensor is left in the loader's dict, so a load holds two copies of one layer at
    most (not of all the routed experts)."""
    from deepinfer.models import deepseek_v41
    from deepinfer.models.deepseek_v41 import dspark_layers, model

    loaded, left = [], []
    read = deepseek_v41.read_weights

    def recorded(*args, **kwargs):
        loaded.extend(read(*args, **kwargs))  # (the text model's tensors, the drafter's)
        return tuple(loaded)

    class Recorded(model.DecoderLayer):
        def __init__(self, ops, cfg, role, *args, prefix=None, **kwargs):
            index = role.layer_id - (cfg.num_hidden_layers if prefix else 0)
            tensors, head = (loaded[1], "mtp.") if prefix else (loaded[0], "layers.")
            left.extend(n for n in tensors if n.startswith(head) and int(n.split(".")[1]) < index)
            super().__init__(ops, cfg, role, *args, prefix=prefix, **kwargs)

    monkeypatch.setattr(deepseek_v41, "read_weights", recorded)
    monkeypatch.setattr(model, "DecoderLayer", Recorded)
    monkeypatch.setattr(dspark_layers, "DecoderLayer", Recorded)
    built = loads(released[0], mode)
    assert loaded[1] == {} and not left and len(built.layers) == built.config.num_hidden_layers
    assert sorted(loaded[0]) == ["embed.weight", "head.weight", "norm.weight"]  # (held as they are)


def _llm(path, monkeypatch, mode: str, nextn: str | None = None):
    monkeypatch.setenv("DEEPINFER_QUANTIZED_WEIGHTS", mode)
    if nextn is not None:
        monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", nextn)
    return LLM(str(path), dtype="float32", max_num_seqs=2, state_cache_bytes=1 << 22)


def test_the_drafter_runs_as_stored(released, monkeypatch):
    drafter = _llm(released[0], monkeypatch, "native").engine.drafter
    assert isinstance(drafter, DSparkDrafter)
    assert isinstance(drafter.main_proj, QuantizedTensor) and isinstance(drafter.layers[0].attn.wo_b, QuantizedTensor)
    experts = drafter.layers[1].ffn
    assert experts.scales is not None and experts.fp8_block is None and experts.w2.dtype == torch.int8
    dense = _llm(released[0], monkeypatch, "dequantize").engine.drafter
    assert isinstance(dense.main_proj, torch.Tensor) and dense.layers[1].ffn.scales is None


def test_the_drafter_is_neither_read_nor_built_when_speculation_is_off(released, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise AssertionError("the drafter was built with speculative decoding off")

    monkeypatch.setattr(DSparkDrafter, "__init__", refuse)
    reads, original = [], WeightReader.load_kept

    def counted(self, name, *args):
        reads.append(name)
        return original(self, name, *args)

    monkeypatch.setattr(WeightReader, "load_kept", counted)
    with caplog.at_level("INFO", logger="deepinfer"):
        llm = _llm(released[0], monkeypatch, "native", nextn="0")
    assert llm.engine.drafter is None and llm.engine.model.dspark is None
    assert reads and not [n for n in reads if n.startswith("mtp.")]
    assert any("speculative decoding off: DEEPINFER_USE_NEXTN_DECODE=0" in r.message for r in caplog.records)


def test_the_log_says_which_weight_mode_and_why(released, monkeypatch, caplog):
    """On the reference backend a quantized checkpoint is dequantized by default; a backend whose op table
    overrides the packed ops keeps it as stored; the variable forces either."""
    from deepinfer.models.weights_mode import PACKED_OPS, weights_mode
    from deepinfer.ops import op_defs

    monkeypatch.delenv("DEEPINFER_QUANTIZED_WEIGHTS", raising=False)
    with caplog.at_level("INFO", logger="deepinfer"):
        load_model(released[0], ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    logged = [r.message for r in caplog.records if "quantized weights of" in r.message]
    assert len(logged) == 1 and ": dequantize (backend 'reference' has no kernel for fp8_block_linear" in logged[0]
    kernels = OpTable({name: op_defs()[name].reference for name in PACKED_OPS}, "packed")
    mode = weights_mode(kernels)
    assert mode.native and "backend 'packed' has kernels for the stored formats" in mode.reason
    assert not weights_mode(OpTable({"fp8_block_linear": op_defs()["fp8_block_linear"].reference}, "some")).native
    monkeypatch.setenv("DEEPINFER_QUANTIZED_WEIGHTS", "dequantize")
    assert weights_mode(kernels).name == "dequantize"
    model = load_model(released[0], ops=kernels, dtype=torch.float32, device=torch.device("cpu"))
    assert model.layers[3].ffn.scales is None
    monkeypatch.delenv("DEEPINFER_QUANTIZED_WEIGHTS")
    model = load_model(released[0], ops=kernels, dtype=torch.float32, device=torch.device("cpu"))
    assert model.layers[3].ffn.scales is not None
