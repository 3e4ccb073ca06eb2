"""Engram tables in host memory on CUDA (``CudaBackend.host_resident``: pinned where they are, read through UVA).

- A host-resident table takes no device memory, its address is host memory, a large one is read in place (a
  write on the host is seen by the next lookup), and the FP8 lookup (``embedding_fp8``'s kernel) and a bf16 table's
  rows (``embedding``) equal the device copy's bit for bit, eager and replayed from a CUDA graph.
- The released-format ``tiny_b`` (FP8 Engram table) gives the same logits, and the same greedy tokens and logprobs
  through the engine (decode graphs captured), with ``engram_placement="host"`` and ``"device"``, bit for bit.

Skipped without a CUDA device.  The CPU forms: ``tests/core/models/deepseek_v41/test_engram_placement.py``.
"""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (SM90/SM100)")

ROWS, DIM, BLOCK = 300_000, 256, 32  # 73 MiB of FP8 codes: above OWN_PAGES_BYTES, registered in place
DEVICE = torch.device("cuda", 0)


def _memory_type(t: torch.Tensor):
    from cuda.bindings import runtime

    err, attrs = runtime.cudaPointerGetAttributes(t.data_ptr())
    assert err == runtime.cudaError_t.cudaSuccess, err
    return attrs.type, runtime.cudaMemoryType


def _tables(gen: torch.Generator):
    codes = torch.randint(0, 256, (ROWS, DIM), generator=gen, dtype=torch.uint8)
    codes[codes == 0x7F] = 0x00  # no table holds the NaN codes
    codes[codes == 0xFF] = 0x80
    scale = torch.randint(100, 150, (ROWS, DIM // BLOCK), generator=gen, dtype=torch.uint8)
    dense = torch.randn(ROWS // 16, DIM, generator=gen).bfloat16()
    return codes.view(torch.float8_e4m3fn), scale, dense


def _lookups(ops, ids, codes, scale, dense):
    return ops.embedding_fp8(ids, codes, scale, BLOCK, torch.bfloat16), ops.embedding(ids % dense.shape[0], dense)


def _same(a, b) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b, strict=True))


def test_what_is_registered_is_whole_pages_of_its_own():
    """(CPU) A small table, or a slice of a larger storage, is copied into an anonymous mapping first; a large
    table that is its whole storage is registered where it is, over the whole pages it spans."""
    import mmap

    from deepinfer_cuda.host_memory import OWN_PAGES_BYTES, _own_pages, _pages

    small = torch.arange(1000, dtype=torch.int32)
    copy = _own_pages(small)
    assert torch.equal(copy, small) and copy.data_ptr() != small.data_ptr() and copy.data_ptr() % mmap.PAGESIZE == 0
    large = torch.empty(OWN_PAGES_BYTES + 3, dtype=torch.uint8)
    assert _own_pages(large) is large
    assert _own_pages(large[1:]) is not large  # a slice: the pages around it are not its own
    start, size = _pages(large)
    first, end = large.data_ptr(), large.data_ptr() + large.nbytes
    assert start % mmap.PAGESIZE == 0 and size % mmap.PAGESIZE == 0
    assert first - mmap.PAGESIZE < start <= first and end <= start + size < end + mmap.PAGESIZE


@requires_cuda
@pytest.mark.cuda
def test_a_host_resident_table_is_read_in_place_with_the_device_copys_bits():
    from deepinfer.ops import OpTable
    from deepinfer_cuda.plugin import CudaBackend

    backend = CudaBackend()
    ops = OpTable.for_backend(backend)
    gen = torch.Generator().manual_seed(0)
    tables = _tables(gen)
    on_device = [t.to(DEVICE) for t in tables]
    before = torch.cuda.memory_allocated(DEVICE)
    host = [t.clone() for t in tables]
    hosted = [backend.host_resident(t, DEVICE) for t in host]
    assert torch.cuda.memory_allocated(DEVICE) == before  # nothing in device memory
    kind, kinds = _memory_type(hosted[0])
    assert kind == kinds.cudaMemoryTypeHost
    assert [(h.device, h.dtype, h.shape) for h in hosted] == [(DEVICE, t.dtype, t.shape) for t in tables]
    ids = torch.randint(0, ROWS, (16 * 24,), generator=gen).to(DEVICE)  # b16: 24 rows a token
    assert _same(_lookups(ops, ids, *hosted), _lookups(ops, ids, *on_device))

    static = ids.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _lookups(ops, static, *hosted)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = _lookups(ops, static, *hosted)
    for seed in range(3):
        static.copy_(torch.randint(0, ROWS, static.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE))
        graph.replay()
        assert _same(captured, _lookups(ops, static, *on_device))

    row = int(ids[0])
    host[0].view(torch.uint8)[row] = 0x38  # e4m3 1.0: a write on the host, seen by the device (no copy)
    torch.cuda.synchronize()
    got = ops.embedding_fp8(ids[:1], hosted[0], hosted[1], BLOCK, torch.float32)
    assert torch.equal(got, torch.exp2(hosted[1][row].cpu().float() - 127).repeat_interleave(BLOCK)[None].to(DEVICE))


@requires_cuda
@pytest.mark.cuda
def test_released_model_gives_the_same_bits_with_host_and_device_engram(tmp_path):
    from deepinfer import LLM, SamplingParams
    from deepinfer.models import load_model
    from deepinfer.ops import OpTable
    from deepinfer_cuda.plugin import CudaBackend
    from tests.support.model_runs import run_chunked
    from tests.support.quantized import V41_RELEASED, quantize_checkpoint, v41_released_layout
    from tests.support.v41_fixtures import FIXTURES, references

    path = quantize_checkpoint(FIXTURES / "tiny_b", tmp_path, v41_released_layout, quantization_config=V41_RELEASED)[0]
    backend = CudaBackend()
    ops = OpTable.for_backend(backend)
    tokens = references("tiny_b")[0].tokens
    prompts = [tokens[:n].tolist() for n in (40, 7, 23)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    runs = {}
    for placement in ("host", "device"):
        model = load_model(path, ops=ops, dtype=torch.bfloat16, device=DEVICE, engram_placement=placement,
                           backend=backend)
        kind, kinds = _memory_type(model.layers[2].engram.weights.table)
        assert (kind == kinds.cudaMemoryTypeHost) == (placement == "host")
        logits = run_chunked(model, tokens[:64], 19)
        llm = LLM.from_model(model, None, ops=ops, backend=backend, max_num_seqs=4, state_cache_bytes=1 << 26)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.runner.decode_graphs is not None and llm.engine.runner.decode_graphs._graphs
        runs[placement] = (logits, [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(
            o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]) for o in outs])
    assert torch.equal(runs["host"][0], runs["device"][0])
    assert runs["host"][1] == runs["device"][1]
