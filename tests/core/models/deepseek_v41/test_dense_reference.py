"""The dense V4.1 reference (tools/train/v41_dense.py) against the HF fixtures.

tiny_b (fake-quant skipped) must match every position within 1e-4. tiny_a (fake-quant active) can only match
statistically: its README measures how far a 1e-7 relative weight perturbation moves HF itself, and the dense
reference must be at least that close. The quantizers are bit-exact against their vectors. ``decoder_keep``
(decoder prefill truncation) must equal the full run when it keeps every row, and otherwise change only what
the decoder's truncated SWA reads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)
from tools.train import v41_dense as vd

FIXTURES = Path(__file__).parents[3] / "fixtures" / "deepseek_v41"
TOL = 1e-4  # tiny_b: HF's own 1e-6 weight perturbation moves it by at most 4.2e-5
# tiny_a README: a 1e-7 relative weight perturbation of HF's own run moves the teacher-forced logprobs by
PERTURBED_FRAC_ABOVE_1E3, PERTURBED_MEDIAN, PERTURBED_P99, PERTURBED_MAX = 0.5858, 5.51e-3, 5.96e-1, 9.65e-1


def _case(name: str) -> tuple[list[list[int]], list[dict]]:
    tokens = json.loads((FIXTURES / name / "tokens.json").read_text())["sequences"]
    return tokens, json.loads((FIXTURES / name / "ref_logprobs.json").read_text())["sequences"]


@pytest.fixture(scope="module")
def tiny_b() -> vd.V41Model:
    return vd.load(FIXTURES / "tiny_b")


@pytest.fixture(scope="module")
def tiny_a() -> vd.V41Model:
    return vd.load(FIXTURES / "tiny_a")


# ------------------------------------------------------------------------------------------- quantizers

QUANTIZERS = {
    "fp8_e4m3_ue8m0_block32": vd.fp8_e4m3_block32,
    "fp4_e2m1_e4m3scale_block16": vd.fp4_e2m1_e4m3scale_block16,
    "fp4_e2m1_ue8m0_block32": vd.fp4_e2m1_ue8m0_block32,
}


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_quantizer_is_bit_exact(name):
    cases = json.loads((FIXTURES / "quantizers" / "quant_vectors.json").read_text())["cases"]
    (case,) = [v for k, v in cases.items() if k.startswith(name)]
    x, want = torch.tensor(case["input"]), torch.tensor(case["output"])
    got = QUANTIZERS[name](x)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # signed zeros included
    odd = x[:, :-1]  # a width that is not a multiple of the block is left alone
    assert torch.equal(QUANTIZERS[name](odd), odd)


def test_fake_quant_is_straight_through():
    x = torch.randn(3, 64, requires_grad=True)
    y = vd._fake(x, vd.fp4_e2m1_ue8m0_block32, True)
    assert not torch.equal(y, x)
    y.backward(torch.arange(192.0).view(3, 64))
    assert torch.equal(x.grad, torch.arange(192.0).view(3, 64))


# ----------------------------------------------------------------------------------------------- engram


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_engram_map_and_hashes_match_hf(name, request):
    model = request.getfixturevalue(name)
    aux = json.loads((FIXTURES / name / "aux_engram_hashes.json").read_text())
    h = model.hasher
    assert h.token_map.tolist() == aux["compressed_token_map"]
    assert h.pad == aux["pad_compressed_id"]
    assert h.primes.tolist() == [sum(layer, []) for layer in aux["primes_per_layer_ngram_head"]]
    assert h.offsets.tolist() == aux["bucket_offsets_per_layer"]
    assert h.mults.tolist() == aux["hash_multipliers_per_layer"]
    ids = _case(name)[0][aux["sequence_index"]]
    assert h(torch.tensor([ids]))[0].tolist() == aux["hash_ids"]


# ------------------------------------------------------------------------------------- against the fixtures


def _assert_top5_close(ids: torch.Tensor, lps: torch.Tensor, ref_ids: list, ref_lps: list, tol: float) -> None:
    """Top-5 logprobs within tol; an id may differ only where it swaps with a near-tie."""
    ref_ids_t, ref_lps_t = torch.tensor(ref_ids), torch.tensor(ref_lps)
    assert (lps - ref_lps_t).abs().max().item() <= tol
    for row, rank in (ids != ref_ids_t).nonzero().tolist():
        mine = (ids[row] == ref_ids_t[row, rank]).nonzero()
        where = lps[row, mine[0, 0]].item() if len(mine) else lps[row, -1].item()  # else: swapped past rank 5
        assert abs(where - ref_lps_t[row, rank].item()) <= tol, (row, rank)


def test_tiny_b_matches_every_position(tiny_b):
    for ids, ref in zip(*_case("tiny_b"), strict=True):
        token_lp, top_ids, top_lp = vd.logprobs(tiny_b, ids)
        diff = (token_lp - torch.tensor(ref["token_logprobs"])).abs()
        assert diff.max().item() <= TOL, f"length {len(ids)}: max |d| {diff.max().item():.3e}"
        _assert_top5_close(top_ids, top_lp, ref["top5_ids"], ref["top5_logprobs"], TOL)


def test_tiny_a_matches_within_the_perturbation_spread(tiny_a):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the thread count changes GEMM rounding, which flips FP4/FP8 grid decisions
    try:
        diffs = []
        for ids, ref in zip(*_case("tiny_a"), strict=True):
            token_lp = vd.logprobs(tiny_a, ids)[0]
            want = torch.tensor(ref["token_logprobs"])
            diff = (token_lp - want).abs()
            assert diff.mean().item() <= PERTURBED_MEDIAN  # per sequence: mean |d| within the median spread
            assert abs(token_lp.mean().item() - want.mean().item()) <= PERTURBED_MEDIAN
            diffs.append(diff)
    finally:
        torch.set_num_threads(threads)
    d = torch.cat(diffs)
    assert (d > 1e-3).float().mean().item() <= PERTURBED_FRAC_ABOVE_1E3
    assert d.median().item() <= PERTURBED_MEDIAN
    assert d.quantile(0.99).item() <= PERTURBED_P99
    assert d.max().item() <= PERTURBED_MAX


def test_each_kv_source_replaces_the_group_lists(tiny_b):
    """Cache-path semantics: layer 4's list holds its own S entries, not layer 1's S/4 ones in front."""
    ids = torch.tensor([_case("tiny_b")[0][3]])
    S, rec = ids.shape[1], {}
    tiny_b(ids, record=rec)
    assert rec["1.kv"].shape[1] == rec["1.index_k"].shape[1] == rec["1.topk_bias"].shape[-1] == S // 4
    assert rec["4.kv"].shape[1] == rec["4.index_k"].shape[1] == S
    assert rec["6.topk_bias"].shape[-1] == rec["8.topk_bias"].shape[-1] == S
    picks = (rec["6.topk_bias"][0] == 0).sum(-1)  # each query attends min(index_topk, p + 1) decoder entries
    assert torch.equal(picks, (torch.arange(S) + 1).clamp(max=tiny_b.cfg.index_topk))


def test_batch_of_equal_length_rows_matches_each_row(tiny_b):
    seqs = _case("tiny_b")[0]
    rows = torch.tensor([seqs[1], seqs[0][:64]])
    with torch.no_grad():
        batched = tiny_b(rows)
        for b in range(2):
            torch.testing.assert_close(batched[b], tiny_b(rows[b : b + 1])[0], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------- decoder truncation


@pytest.fixture(scope="module")
def seq0_full(tiny_b):
    ids = torch.tensor([_case("tiny_b")[0][0]])
    rec: dict = {}
    with torch.no_grad():
        return ids, tiny_b(ids, record=rec), rec


def _kept_logprob_diff(logits: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """max_v |Δ log p| per kept row."""
    return (logits.log_softmax(-1) - full[:, -logits.shape[1] :].log_softmax(-1)).abs().amax(-1)[0]


def test_decoder_keep_covering_the_sequence_is_the_full_run(tiny_b, seq0_full):
    ids, full, rec_full = seq0_full
    rec: dict = {}
    with torch.no_grad():
        assert torch.equal(tiny_b(ids, decoder_keep=ids.shape[1], record=rec), full)
    assert rec.keys() == rec_full.keys() and all(torch.equal(rec[k], rec_full[k]) for k in rec)


def test_decoder_keep_truncates_only_the_decoder(tiny_b, seq0_full):
    """KEEP = W: kept rows change (the decoder SWA reads from the floor up), the global KV path does not."""
    ids, full, rec_full = seq0_full
    keep, cut = tiny_b.cfg.sliding_window, tiny_b.decoder_source()
    rec: dict = {}
    with torch.no_grad():
        out = tiny_b(ids, decoder_keep=keep, record=rec)
    assert out.shape == (1, keep, tiny_b.cfg.vocab_size)
    for key in ("1.kv", "1.index_k", "1.topk_bias", f"{cut}.kv", f"{cut}.index_k"):  # every row, as in the full run
        assert torch.equal(rec[key], rec_full[key]), key
    # the decoder source's own selection for the kept rows: its x and the keys are the full run's
    assert torch.equal(rec[f"{cut}.topk_bias"], rec_full[f"{cut}.topk_bias"][:, -keep:])
    diff = _kept_logprob_diff(out, full)
    assert diff.max().item() > 0.1 and diff[-1].item() > 0.01  # measured: max 4.48, last row 0.60


def test_decoder_keep_with_the_dependency_halo_is_exact_for_the_last_row(tiny_b, seq0_full):
    """Only stacked SWA is truncated: keeping W + (n_dec-1)(W-1) rows leaves the last row's inputs intact."""
    ids, full, _ = seq0_full
    W, cut = tiny_b.cfg.sliding_window, tiny_b.decoder_source()
    n_dec = tiny_b.cfg.num_hidden_layers - cut
    with torch.no_grad():
        halo = _kept_logprob_diff(tiny_b(ids, decoder_keep=W + (n_dec - 1) * (W - 1)), full)
        short = _kept_logprob_diff(tiny_b(ids, decoder_keep=(n_dec - 1) * (W - 1)), full)
    assert halo[-1].item() <= 1e-5
    assert halo.max().item() > 0.1  # earlier kept rows still lose their window
    assert short[-1].item() > 10 * halo[-1].item()


def test_decoder_keep_rejects_bad_values(tiny_b):
    ids = torch.tensor([[0, 5, 7]])
    with pytest.raises(ValueError, match="decoder_keep must be >= 1"):
        tiny_b(ids, decoder_keep=0)
    encoder_only = vd.V41Model(_small_config(compress_ratios=[0, 2, 2]))
    with pytest.raises(ValueError, match="ratio-1 last kv source"):
        encoder_only(ids, decoder_keep=2)


# ------------------------------------------------------------------------------------ config and training


def _small_config(**kw) -> vd.V41Config:
    base = dict(vocab_size=32, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, head_dim=12,
                qk_rope_head_dim=4, q_lora_rank=8, o_groups=2, o_lora_rank=4, sliding_window=4, index_n_heads=2,
                index_head_dim=8, index_topk=2, n_routed_experts=3, num_experts_per_tok=2,
                moe_intermediate_size=8, hc_mult=2, num_nextn_predict_layers=0)  # fmt: skip
    return vd.V41Config(**{**base, **kw})


def test_released_config_form():
    text = dict(num_hidden_layers=40, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
                engram_pad_token_id=5, engram_layer_ids=[1, 14], rope_theta=10000, compress_rope_theta=160000,
                rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                              "original_max_position_embeddings": 65536})  # fmt: skip
    cfg = vd.V41Config.from_dict({"model_type": "deepseek_v41", "text_config": text, "vision_config": None})
    assert len(cfg.compress_ratios) == 40 and cfg.engram_pad_id == 5
    assert cfg.kv_source_layer_ids == [2, 8, 14, 20] and cfg.candidate_source_layer_id == 20
    assert cfg.index_source_layer_ids == [2, 8, 14, 20, 24, 28, 32, 36]
    inv, scaling = vd.rope_table(cfg.rope_parameters["compress"], cfg.head_dim)
    freq = 160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    assert scaling == 1.0 and inv.shape == (32,)
    assert torch.equal(inv[:15], 1 / freq[:15]) and torch.equal(inv[25:], 1 / (16 * freq[25:]))  # ramp 15..25
    assert not torch.equal(inv[15:25], 1 / freq[15:25])
    legacy = vd.V41Config.from_dict({**text, "rope_scaling": {"type": "yarn", "factor": 16}})
    assert legacy.rope_parameters["compress"]["rope_type"] == "default"  # HF reads rope_type: no YaRN


def test_gradients_reach_the_weights_through_the_fake_quantizers(tiny_a):
    ids = torch.tensor([_case("tiny_a")[0][0][:40]])
    tiny_a.zero_grad()
    logits = tiny_a(ids)
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    grads = {name: p.grad for name, p in tiny_a.named_parameters()}
    try:
        for name in ("embed.weight", "layers.0.hc_attn_fn", "layers.0.attn.attn_sink", "layers.6.attn.wkv.weight",
                     "layers.6.attn.compressor.wkv.weight", "layers.4.engram.embed.weight", "head.weight",
                     "layers.9.ffn.experts.0.w2.weight", "layers.9.ffn.gate.weight"):  # fmt: skip
            assert grads[name] is not None and grads[name].abs().sum() > 0, name
        assert grads["layers.8.attn.indexer.wq_b.weight"] is None  # the indexer only selects
        assert all(math.isfinite(g.abs().sum().item()) for g in grads.values() if g is not None)
    finally:
        tiny_a.zero_grad(set_to_none=True)
