"""``DEEPINFER_QUANTIZED_KV=1``: V4.1's state in the model's own formats (SWA FP8 + ue8m0 per 32, compressed
latents FP4 + e4m3 per 16, indexer keys FP4 + ue8m0 per 32).  The forward fake-quantizes exactly there, so the
logits must not change by one bit: on ``tiny_a`` (head dim 64, index head dim 32: every format stored), whole,
chunked, decoded token by token (the pool grows and moves the packed rows), in a ragged batch, forked, in fp32 and
bf16.  The state takes the stored bytes: fewer per token than the model's dtype."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.kv.sizing import describe_density, tokens_per_gib
from deepinfer.kv.spec import entries_name
from deepinfer.models import ForwardBatch, load_model
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.state import state_spec
from deepinfer.ops import OpTable
from tests.support.model_runs import run_chunked, run_ragged, run_schedule
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)
from tests.support.v41_fixtures import FIXTURES, references


def _load(monkeypatch, quantized: bool, dtype=torch.float32):
    monkeypatch.setenv("DEEPINFER_QUANTIZED_KV", "1" if quantized else "0")
    return load_model(FIXTURES / "tiny_a", ops=OpTable(), dtype=dtype, device=torch.device("cpu"))


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b), f"logprobs differ by up to {float((a - b).abs().max()):.3g}"


def test_the_state_stores_the_formats_and_counts_their_bytes(monkeypatch):
    model, plain = _load(monkeypatch, True), _load(monkeypatch, False)
    tokens = references("tiny_a")[0].tokens[:40]
    run_chunked(model, tokens, 40)
    t, spec = model.pool.tensors, model.state_spec
    cfg = model.config
    sliding = next(r.layer_id for r in cfg.layers if not r.ratio)
    source = next(r.layer_id for r in cfg.layers if r.mode == "full")
    assert t[f"layers.{sliding}.kv"].dtype == torch.uint8 and t[f"layers.{sliding}.kv"].shape[1] == 64 + 2
    assert t[f"groups.{source}.kv"].shape[1] == 66  # rings: FP8 codes + one ue8m0 byte per 32
    assert t[entries_name(f"groups.{source}.kv")].shape[1] == 32 + 4  # entries: FP4 pairs + one e4m3 per 16
    assert t[f"groups.{source}.index_keys"].shape[1] == 16 + 1  # FP4 pairs + one ue8m0 per 32
    n = 4096
    packed, dense = spec.state_bytes(n, 4), plain.state_spec.state_bytes(n, 4)
    assert dense / packed > 5  # fp32 state: 4 bytes a value against ~1 (FP8) and ~0.6 (FP4)
    assert model.state_bytes(n) == packed
    assert tokens_per_gib(spec, 4) > 5 * tokens_per_gib(plain.state_spec, 4)
    assert "with every row in the model's dtype" in describe_density(spec, 4)
    assert "model's dtype" not in describe_density(plain.state_spec, 4)


def test_v41_flash_state_density_against_bf16():
    """The released geometry's stored bytes per token (DeepSeek's: SWA 528 B, latent 288 B, indexer key 68 B):
    the pages of a long sequence take ~3.6x fewer bytes than bf16 rows."""
    cfg = DeepseekV41Config.from_file(FIXTURES / "tiny_b")
    flash = dataclasses.replace(cfg, head_dim=512, index_head_dim=128)
    packed, plain = state_spec(flash, quantized=True), state_spec(flash)
    _, pages = packed.byte_sizes(2)
    _, plain_pages = plain.byte_sizes(2)
    ratios = {r: plain_pages[r] / pages[r] for r in pages}
    assert all(abs(v - (1024 + 256) / (288 + 68)) < 1e-9 for v in ratios.values()), ratios


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_bit_for_bit_the_fake_quantized_state(monkeypatch, dtype):
    quantized, plain = _load(monkeypatch, True, dtype), _load(monkeypatch, False, dtype)
    tokens = references("tiny_a")[0].tokens[:100]  # past the top-k (8) and the candidate pool (6 blocks of 4)
    _same(run_chunked(quantized, tokens, len(tokens)), run_chunked(plain, tokens, len(tokens)))
    schedule = [70] + [1] * (len(tokens) - 70)  # prefill, then decode steps reading the packed rows in place
    _same(run_schedule(quantized, tokens, schedule), run_schedule(plain, tokens, schedule))


def test_chunked_and_ragged_batches_are_bit_for_bit(monkeypatch):
    quantized, plain = _load(monkeypatch, True), _load(monkeypatch, False)
    seqs = [r.tokens[:64] for r in references("tiny_a")[1:]]
    _same(run_chunked(quantized, seqs[0], 13), run_chunked(plain, seqs[0], 13))
    lens = [len(s) for s in seqs]
    schedule = [[min(20, n) for n in lens], *[[1 if n > 20 + k else 0 for n in lens] for k in range(max(lens) - 20)]]
    for a, b in zip(run_ragged(quantized, seqs, schedule), run_ragged(plain, seqs, schedule), strict=True):
        _same(a, b)


def test_a_forked_state_continues_bit_for_bit(monkeypatch):
    """A fork copies the packed rings and entry pages (two tensors per group)."""
    outs = []
    for quantized in (True, False):
        model = _load(monkeypatch, quantized)
        tokens = references("tiny_a")[1].tokens
        state = model.new_state()
        with torch.no_grad():
            model.forward(ForwardBatch(tokens[:30], torch.arange(30), [30], [state]))
            child = model.pool.fork(state)
            logits = []
            for p in range(30, 40):
                hidden = model.forward(ForwardBatch(tokens[p : p + 1], torch.tensor([p]), [1], [child]))
                logits.append(model.compute_logits(hidden))
        outs.append(torch.cat(logits))
    _same(*outs)


def test_decode_reads_the_packed_rows_in_place(monkeypatch):
    """A decode step reads the packed rings and entries through ``sparse_attention_packed_inverse_rope`` and the
    packed indexer keys through the ``indexer_*_packed`` ops: no row is unpacked, no unpacked pool is attended."""
    calls: dict[str, int] = {}
    ops = OpTable()

    def counted(name, op):
        def call(*args):
            calls[name] = calls.get(name, 0) + 1
            return op(*args)

        return call

    names = ("sparse_attention_packed_inverse_rope", "sparse_attention_inverse_rope", "fp8_e4m3_unpack",
             "fp4_e2m1_unpack", "indexer_topk_packed", "indexer_candidates_packed", "indexer_topk_in_blocks_packed",
             "indexer_topk", "indexer_candidates", "indexer_topk_in_blocks")
    for name in names:
        setattr(ops, name, counted(name, getattr(ops, name)))
    monkeypatch.setenv("DEEPINFER_QUANTIZED_KV", "1")
    model = load_model(FIXTURES / "tiny_a", ops=ops, dtype=torch.float32, device=torch.device("cpu"))
    tokens = references("tiny_a")[0].tokens[:100]  # past the top-k (8): the index sources score
    state = model.new_state()
    with torch.no_grad():
        model.forward(ForwardBatch(tokens[:90], torch.arange(90), [90], [state]))
        assert not {"indexer_topk", "indexer_candidates", "indexer_topk_in_blocks"} & set(calls), calls
        calls.clear()
        model.forward(ForwardBatch(tokens[90:91], torch.tensor([90]), [1], [state]))
    assert calls.get("sparse_attention_packed_inverse_rope") == model.config.num_hidden_layers, calls
    scored = sum(calls.get(n, 0) for n in names[4:7])
    assert scored == sum(1 for r in model.config.layers if r.is_index_source) and scored > 0, calls
    assert set(calls) <= set(names[:1] + names[4:7]), calls  # nothing unpacked, nothing scored on values
