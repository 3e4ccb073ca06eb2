"""Engram tables in host memory (``engram_placement="host"``, the default) or device memory: the model reads the
tables the backend's ``host_resident`` hands back and gives the same logits bit for bit; a table's load reads only
the rows asked for (a rank's shard) from the memory-mapped file, a chunk at a time, its scales checked per chunk
(no transient the size of a table); a bad placement is refused naming the argument.  The EP2 gloo forms are in
``tests/core/parallel/test_engram_ep.py``; the CUDA form (pinned + UVA) in
``tests/backend_cuda/test_engram_host_gpu.py``."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer import LLM
from deepinfer.engine.args import EngineArgs
from deepinfer.models import load_model, read_model_config
from deepinfer.models.checkpoint import CheckpointError
from deepinfer.models.deepseek_v41.weights import read_weights
from deepinfer.models.weight_reader import WeightReader
from deepinfer.ops import OpTable
from deepinfer.quant import QuantizedTensor
from tests.support.engram_placement import ElsewhereBackend, RecordingCheckpoint
from tests.support.model_runs import run_chunked
from tests.support.quantized import V41_RELEASED, quantize_checkpoint, v41_released_layout
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)
from tests.support.v41_fixtures import FIXTURES, references

TABLE, SCALE = "layers.2.engram.embed.weight", "layers.2.engram.embed.scale"


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """tiny_b with FP8 Engram tables (ue8m0 scales per 32 columns), as released."""
    target = tmp_path_factory.mktemp("released_engram")
    return quantize_checkpoint(FIXTURES / "tiny_b", target, v41_released_layout, quantization_config=V41_RELEASED)[0]


def _load(path, placement, backend=None):
    return load_model(path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"),
                      engram_placement=placement, backend=backend)


@pytest.mark.parametrize("form", ["float table", "fp8 table"])
def test_host_and_device_placement_give_the_same_logits_bit_for_bit(form, released):
    path = released if form == "fp8 table" else FIXTURES / "tiny_b"
    backend = ElsewhereBackend()
    host, device = _load(path, "host", backend), _load(path, "device")
    engram = host.layers[2].engram.weights
    placed = [engram.table, engram.table_scale] if form == "fp8 table" else [engram.table]
    assert [id(t) for t in placed] == [id(t) for t in backend.placed]  # the model reads what the backend handed
    assert device.layers[2].engram.weights.table.dtype == engram.table.dtype
    tokens = references("tiny_b")[0].tokens[:40]
    assert torch.equal(run_chunked(host, tokens, 13), run_chunked(device, tokens, 13))


def test_a_table_load_reads_only_its_rows_a_chunk_at_a_time(released, monkeypatch):
    """A rank's shard (rows 681..1362 of 1362) is read in chunks of CHUNK_BYTES from the file: no whole read of
    the table or its scales, every chunk inside the shard, together exactly the shard, values as stored."""
    monkeypatch.setattr(WeightReader, "CHUNK_BYTES", 32 * 100)  # 100 rows of 32 FP8 columns
    ckpt = RecordingCheckpoint(released)
    shard = slice(681, 1362)
    tensors, _ = read_weights(ckpt, read_model_config(released), torch.float32, torch.device("cpu"),
                              rows=lambda name, n: shard)
    table = tensors[TABLE]
    assert isinstance(table, QuantizedTensor) and table.shape == (681, 32) and table.block == (1, 32)
    for name, most in ((TABLE, 100), (SCALE, 3200)):  # scales: one byte a row, so 3200 rows a chunk
        reads = [rows for n, rows in ckpt.reads if n == name]
        assert None not in reads, f"{name} was read whole"
        chunks = [(r.start, r.stop) for r in reads if r.stop > r.start]
        assert chunks[0][0] == shard.start and chunks[-1][1] == shard.stop
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))  # contiguous, no overlap
        assert max(stop - start for start, stop in chunks) <= most
    whole = load_file(str(released / "model.safetensors"))
    assert torch.equal(table.data.view(torch.uint8), whole[TABLE][shard].view(torch.uint8))
    assert torch.equal(table.scale.view(torch.uint8), whole[SCALE][shard].view(torch.uint8))


def test_scales_are_checked_a_chunk_at_a_time(released, monkeypatch, tmp_path):
    """The scale check converts one chunk at a time (never the table's scales whole, ~23 GiB for the released
    model), and a NaN scale in the last chunk is still found, naming the tensor."""
    import deepinfer.models.weight_reader as weight_reader

    monkeypatch.setattr(WeightReader, "CHUNK_BYTES", 400)  # 400 rows of scales a chunk
    checked: list[int] = []
    check = weight_reader.check_finite

    def counted(where, tensor, stored=None):
        if "engram.embed.scale" in where:
            checked.append(tensor.numel())
        check(where, tensor, stored)

    monkeypatch.setattr(weight_reader, "check_finite", counted)
    _load(released, "host")
    assert checked == [400, 400, 400, 162]
    broken = tmp_path / "nan_scale"
    shutil.copytree(released, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors[SCALE] = tensors[SCALE].view(torch.uint8).clone()
    tensors[SCALE][1300, 0] = 255  # e8m0 NaN
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"engram\.embed\.scale: expected finite values, found 1 of 162"):
        _load(broken, "host")


def test_engram_placement_is_checked():
    with pytest.raises(ValueError, match=r"engram_placement must be one of \['host', 'device'\], got 'gpu'"):
        EngineArgs(engram_placement="gpu")
    with pytest.raises(TypeError, match="engram_placement must be one of"):
        EngineArgs(engram_placement=1)
    with pytest.raises(ValueError, match=r"engram_placement must be one of \['host', 'device'\]"):
        _load(FIXTURES / "tiny_b", "cuda")
    model = _load(FIXTURES / "tiny_b", "device")
    with pytest.raises(TypeError, match="does not take engram_placement"):
        LLM.from_model(model, None, engram_placement="host")


def test_llm_keeps_engram_tables_in_host_memory_by_default(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="deepinfer"):
        llm = LLM(str(FIXTURES / "tiny_b"), dtype="float32", max_num_seqs=2, state_cache_bytes=1 << 22)
    assert llm.engine_args.engram_placement == "host"
    assert "Engram tables: 0.00 GiB in host memory" in caplog.text
