"""The DSpark drafter (``models/deepseek_v41/dspark.py``) and the target's feature capture against the dense
drafter (``tools/train/dspark_dense.py``: plain PyTorch from the description, no DeepInfer code).

The target is the ``tiny_b`` fixture (9 layers, window 24, Engram, every CSA2 role) with random ``mtp.*`` tensors
written in the released naming into a copy of its checkpoint, loaded through DeepInfer's own loader.
"""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.kv.pool import PooledState
from deepinfer.models import ForwardBatch, load_model
from deepinfer.models.deepseek_v41.dspark import DSparkDrafter
from deepinfer.models.deepseek_v41.dspark_weights import check_mtp, expected_mtp_shapes
from deepinfer.ops import OpTable
from deepinfer.spec_decode.drafter import DraftRequest
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)
from tests.support.v41_fixtures import FIXTURES
from tools.train import dspark_dense as dd
from tools.train.dspark_accept import slot_state

TOL = 1e-5
SPEC = dd.DSparkSpec(num_layers=2, block_size=4, noise_token_id=383, target_layer_ids=[3, 6, 8], markov_rank=16,
                     n_routed_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the folder, the dense target, the dense drafter)."""
    folder = tmp_path_factory.mktemp("dspark") / "tiny_b_dspark"
    return folder, *dd.write_drafter_checkpoint(folder, FIXTURES / "tiny_b", SPEC, seed=3)


@pytest.fixture(scope="module")
def setup(checkpoint):
    folder, target, dense = checkpoint
    model = load_model(folder, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    return target, dense, model


@pytest.fixture(scope="module")
def sequence():
    tokens = json.loads((FIXTURES / "tiny_b" / "tokens.json").read_text())["sequences"]
    return torch.tensor(next(t for t in tokens if len(t) >= 60)[:60])


def dense_features(target, dense, ids):
    with torch.no_grad():
        return dd.DSparkDense.target_features(target, ids[None], dense.spec.target_layer_ids)


def captured(model, ids, chunks):
    """The model's captured features of every row, feeding ``ids`` in ``chunks``."""
    state, out, start = model.new_state(), [], 0
    with torch.no_grad():
        for n in chunks:
            batch = ForwardBatch(ids[start : start + n], torch.arange(start, start + n), [n], [state],
                                 capture_rows=torch.arange(n))
            model.forward(batch)
            out.append(batch.captured)
            start += n
    return torch.cat(out)


@pytest.mark.parametrize("chunks", [[60], [23, 17, 20], [50] + [1] * 10])
def test_capture_is_the_stream_mean_of_the_target_layers(setup, sequence, chunks):
    target, dense, model = setup
    _, expected = dense_features(target, dense, sequence)
    got = captured(model, sequence, chunks)
    assert got.shape == (60, 3 * 64)
    assert float((got - expected[0]).abs().max()) <= TOL


def test_capture_selected_rows_only_and_off_by_default(setup, sequence):
    target, dense, model = setup
    _, expected = dense_features(target, dense, sequence)
    rows = torch.tensor([59, 0, 31])
    batch = ForwardBatch(sequence, torch.arange(60), [60], [model.new_state()], capture_rows=rows)
    with torch.no_grad():
        model.forward(batch)
    assert float((batch.captured - expected[0, rows]).abs().max()) <= TOL
    plain = ForwardBatch(sequence, torch.arange(60), [60], [model.new_state()])
    with torch.no_grad():
        model.forward(plain)
    assert plain.captured is None


def test_capture_under_decoder_prefill_truncation(setup, checkpoint, sequence, monkeypatch):
    """KEEP = 40 of a 60-token prompt: layer 3 (before the decoder, layer 4) has every row, layers 6 and 8 only
    the kept rows 20..59; the others read zeros."""
    target, _, _ = setup
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "40")
    model = load_model(checkpoint[0], ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    batch = ForwardBatch(sequence, torch.arange(60), [60], [model.new_state()], needed_from=[59],
                         capture_rows=torch.arange(60))
    taken: dict[int, torch.Tensor] = {}
    hooks = [target.layers[i].register_forward_hook(lambda _m, _a, out, i=i: taken.__setitem__(i, out[0].mean(2)))
             for i in (3, 6, 8)]
    with torch.no_grad():
        model.forward(batch)
        target(sequence[None], decoder_keep=40)
    for h in hooks:
        h.remove()
    got = batch.captured.view(60, 3, 64)
    assert float((got[:, 0] - taken[3][0]).abs().max()) <= TOL
    for part, layer in ((1, 6), (2, 8)):
        assert float((got[20:, part] - taken[layer][0]).abs().max()) <= TOL
        assert not got[:20, part].any()


def drafter_for(model, features, prefixes: list[int], slots: list[int]) -> DSparkDrafter:
    """A drafter whose slot ``slots[i]`` holds the features of positions 0 .. prefixes[i]-1 (one extend call)."""
    drafter = DSparkDrafter.from_model(model, num_slots=8)
    rows = [(s, p) for s, n in zip(slots, prefixes, strict=True) for p in range(n)]
    positions = [p for _, p in rows]
    drafter.extend([slot_state(s) for s, _ in rows], torch.tensor(positions), features[positions])
    return drafter


def test_draft_block_matches_the_dense_drafter(setup, sequence):
    """Blocks anchored before and after the window fills (W = 24), several requests in one call."""
    target, dense, model = setup
    _, feats = dense_features(target, dense, sequence)
    anchors, slots, k = [5, 30, 47], [1, 4, 7], SPEC.block_size
    drafter = drafter_for(model, feats[0], anchors, slots)
    requests = [DraftRequest(slot_state(s), int(sequence[p]), p, 0.0, 0, 0)
                for s, p in zip(slots, anchors, strict=True)]
    with torch.no_grad():
        hidden, logits = drafter.block(requests, k)
        drafts = drafter.draft(requests, k)
        contexts = dense.contexts(feats)
        anchor_t = torch.tensor(anchors)
        d_hidden, d_logits = dense.block(contexts, torch.zeros(3, dtype=torch.long), anchor_t, sequence[anchor_t], k,
                                         target.embed.weight, target.head.weight)
        d_tokens, d_conf, _ = dense.draft_greedy(d_hidden, d_logits, sequence[anchor_t])
    assert float((hidden - d_hidden).abs().max()) <= TOL
    assert float((logits - d_logits).abs().max()) <= TOL
    assert torch.equal(drafts.tokens, d_tokens)
    assert float((drafts.confidence - d_conf).abs().max()) <= TOL
    assert drafts.tokens.shape == (3, k) and drafts.confidence.shape == (3, k)
    again = drafter.draft(requests, k)  # drafting does not change the context
    assert torch.equal(again.tokens, drafts.tokens) and torch.equal(again.confidence, drafts.confidence)
    short = drafter.draft(requests, 2)  # a shorter block is its own forward: only its first token must agree
    assert short.tokens.shape == (3, 2)


def test_sampled_drafts_follow_the_markov_chain(setup, sequence):
    """A sampled row's draft j is sample_tokens' race over softmax(Markov-biased logits / T), given the token drawn
    before it, with the request's seed at output position s + j (the verifier's noise there); a greedy row in the
    same batch takes the argmax.  Equal seeds and positions draft equal tokens; other seeds, or the same seed at
    other output positions, other tokens."""
    target, dense, model = setup
    _, feats = dense_features(target, dense, sequence)
    drafter = drafter_for(model, feats[0], [40, 40], [2, 3])
    temps, seeds, s = [0.8, 0.0], [7, 7], 13
    requests = [DraftRequest(slot_state(slot), int(sequence[40]), 40, t, seed, s)
                for slot, t, seed in zip([2, 3], temps, seeds, strict=True)]
    with torch.no_grad():
        drafts = drafter.draft(requests, SPEC.block_size)
        hidden, logits = drafter.block(requests, SPEC.block_size)
    prev = torch.full((2,), int(sequence[40]))
    ops = OpTable()
    for j in range(SPEC.block_size):
        with torch.no_grad():
            step, _ = dense.heads(hidden[:, j], logits[:, j], prev)
        drawn = ops.sample_tokens(step[:1] / temps[0], torch.tensor([False]), torch.tensor([7]),
                                  torch.tensor([s + j]))
        assert int(drafts.tokens[0, j]) == int(drawn[0]) and int(drafts.tokens[1, j]) == int(step[1].argmax())
        prev = drafts.tokens[:, j]
    again = drafter.draft([DraftRequest(r.state, r.anchor, r.position, r.temperature, r.seed, r.step)
                           for r in requests], SPEC.block_size)
    assert torch.equal(again.tokens, drafts.tokens)

    def first(seed: int, step: int) -> torch.Tensor:
        return drafter.draft([DraftRequest(slot_state(2), requests[0].anchor, 40, 0.8, seed, step)],
                             SPEC.block_size).tokens[0]

    assert torch.equal(first(7, s), drafts.tokens[0])
    assert any(not torch.equal(first(seed, s), drafts.tokens[0]) for seed in range(8, 16))
    assert any(not torch.equal(first(7, step), drafts.tokens[0]) for step in range(s + 1, s + 9))


def test_sampled_drafts_are_distributed_as_q(setup, sequence):
    """Over 2000 seeds (one request each, one batch), the first two drafts' counts fit the Markov chain's
    distribution: the first by q_0, the second given the first x by q_1(. | x) (chi-square tests, cells of expected
    count >= 5, the rest pooled)."""
    target, dense, model = setup
    _, feats = dense_features(target, dense, sequence)
    drafter = drafter_for(model, feats[0], [40], [2])
    n, t = 2000, 1.5
    requests = [DraftRequest(slot_state(2), int(sequence[40]), 40, t, seed, 0) for seed in range(n)]
    with torch.no_grad():
        drafts = drafter.draft(requests, 2)
        hidden, logits = drafter.block(requests[:1], 2)  # one anchor: one q_0, one q_1(. | x) per first draft x

    @torch.no_grad()
    def q(j: int, prev: int) -> torch.Tensor:
        step, _ = dense.heads(hidden[:, j], logits[:, j], torch.tensor([prev]))
        return torch.softmax(step[0].double() / t, -1)

    q0 = q(0, int(sequence[40]))
    first = drafts.tokens[:, 0]
    assert _chi_square_p(torch.bincount(first, minlength=384).double(), q0 * n) > 1e-3
    # the second draft given the first: q_1 of each row (conditioned on its own first draft)
    pair = first * 384 + drafts.tokens[:, 1]
    expected = torch.zeros(384 * 384, dtype=torch.float64)
    for x in first.unique().tolist():  # given the first draft x, the second follows q_1(. | x)
        rows = (first == x).nonzero()[:, 0]
        expected[x * 384 : (x + 1) * 384] = q(1, x) * len(rows)
    assert _chi_square_p(torch.bincount(pair, minlength=384 * 384).double(), expected) > 1e-3
    assert len(first.unique()) > 5  # negative control: the drafts do vary


def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of observed counts against expected ones (cells below 5 pooled into one)."""
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor((len(exp) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def test_truncate_free_and_fork(setup, sequence):
    target, dense, model = setup
    _, feats = dense_features(target, dense, sequence)
    drafter = drafter_for(model, feats[0], [33], [0])
    at = [DraftRequest(slot_state(0), int(sequence[30]), 30, 0.0, 0, 0)]
    # positions 30..32 forgotten: the draft at 30 reads its window 6 .. 29 (the ring's 24 + 4 spare rows kept 5+)
    drafter.truncate(slot_state(0), 30)
    with torch.no_grad():
        hidden, _ = drafter.block(at, 3)
        visible = (torch.arange(60) >= 30 - 24) & (torch.arange(60) < 30)
        d_hidden, _ = dense.block(dense.contexts(feats), torch.zeros(1, dtype=torch.long), torch.tensor([30]),
                                  sequence[30:31], 3, target.embed.weight, target.head.weight, visible[None])
    assert float((hidden - d_hidden).abs().max()) <= TOL
    # re-extending is harmless; 5 is too old
    drafter.extend([slot_state(0)] * 2, torch.tensor([29, 5]), feats[0, [29, 5]])
    with torch.no_grad():
        hidden = drafter.block(at, 3)[0]  # 29's latent came from another GEMM shape: equal up to rounding
    assert float((hidden - d_hidden).abs().max()) <= TOL
    drafter.fork(slot_state(0), slot_state(5))
    with torch.no_grad():
        forked, _ = drafter.block([DraftRequest(slot_state(5), at[0].anchor, 30, 0.0, 0, 0)], 3)
    assert torch.equal(forked, hidden)
    drafter.free(slot_state(0))
    with torch.no_grad():
        empty, _ = drafter.block(at, 3)
        d_empty, _ = dense.block(dense.contexts(feats), torch.zeros(1, dtype=torch.long), torch.tensor([30]),
                                 sequence[30:31], 3, target.embed.weight, target.head.weight,
                                 torch.zeros(1, 60, dtype=torch.bool))
    assert float((empty - d_empty).abs().max()) <= TOL


def test_rows_a_verify_step_rejects_never_reach_a_draft(setup, sequence):
    """A captured verify step extends all its rows (``extend_rows``), rejected drafts too: the next draft equals
    the one after extending the kept rows alone.  Rows 41..44 land on ring rows that held 13..16 (R = 24 + 4
    spare), outside the next window 17..40; without the spare rows they would replace 17..20 of it."""
    target, dense, model = setup
    _, feats = dense_features(target, dense, sequence)
    k = SPEC.block_size
    kept = drafter_for(model, feats[0], [41], [1])  # positions 0 .. 40: the anchor at 40 kept, its drafts rejected
    verified = drafter_for(model, feats[0], [40], [1])
    garbage = torch.randn(k, feats.shape[-1], generator=torch.Generator().manual_seed(5))
    verified.extend_rows(torch.ones(k + 1, dtype=torch.int64), torch.arange(40, 41 + k),
                         torch.cat([feats[0, 40:41], garbage]))
    at = [DraftRequest(slot_state(1), int(sequence[41]), 41, 0.0, 0, 0)]
    with torch.no_grad():
        want, got = kept.block(at, k), verified.block(at, k)
    assert float((got[0] - want[0]).abs().max()) <= TOL and float((got[1] - want[1]).abs().max()) <= TOL
    assert torch.equal(kept.draft(at, k).tokens, verified.draft(at, k).tokens)


def test_bad_inputs_are_named(setup, sequence):
    _, _, model = setup
    drafter = DSparkDrafter.from_model(model, num_slots=2)
    assert drafter.max_draft_len == SPEC.block_size and drafter.capture_layer_ids == (3, 6, 8)
    request = DraftRequest(slot_state(0), 5, 3, 0.0, 0, 0)
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
        drafter.draft([request], 5)
    with pytest.raises(ValueError, match=r"slot must be in \[0, 2\)"):
        drafter.draft([DraftRequest(slot_state(2), 5, 3, 0.0, 0, 0)], 2)
    with pytest.raises(ValueError, match="expected 192"):
        drafter.extend([slot_state(0)], torch.tensor([0]), torch.zeros(1, 64))
    with pytest.raises(ValueError, match="one state and position per row"):
        drafter.extend([slot_state(0)] * 2, torch.tensor([0]), torch.zeros(1, 192))
    with pytest.raises(TypeError, match="pooled states, got object"):
        drafter.draft([DraftRequest(object(), 5, 3, 0.0, 0, 0)], 2)
    with pytest.raises(ValueError, match="hold a slot"):
        drafter.draft([DraftRequest(PooledState(None), 5, 3, 0.0, 0, 0)], 2)
    drafter.free(PooledState(None))  # a state that never held a slot has no context to forget


def test_mtp_tensors_are_checked_by_name_and_shape(checkpoint, setup):
    from deepinfer.models.checkpoint import SafetensorsCheckpoint

    _, _, model = setup
    cfg, stored = model.config, SafetensorsCheckpoint(checkpoint[0])
    shapes = {k: tuple(stored.shape(k)) for k in stored.names() if k.startswith("mtp.")}
    assert {k for k in shapes if not k.endswith(".gate.bias_vl")} == set(expected_mtp_shapes(cfg))
    check_mtp(cfg, shapes, "tiny_b")  # (image tokens' gate.bias_vl: allowed, not read)
    bad = dict(shapes)
    del bad["mtp.1.markov_head.head.weight"]
    bad["mtp.0.attn.wkv.weight"] = (3, 3)
    bad["mtp.0.e_proj.weight"] = (2, 2)
    with pytest.raises(ValueError, match=r"(?s)3 problems.*markov_head.head.weight: missing.*wkv.weight: shape "
                                         r"\(3, 3\), expected \(40, 64\).*e_proj.weight: unexpected"):
        check_mtp(cfg, bad, "tiny_b")


def released_layout(name: str, w: torch.Tensor):
    """The drafter as released: its dense projections FP8 (32x32 blocks on mtp.0, 128x128 on mtp.1: detected per
    tensor), routed experts MXFP4 where K is a multiple of 32 (else FP8); the backbone left as it is."""
    if not name.startswith("mtp.") or not name.endswith(".weight"):
        return None
    if ".ffn.experts." in name:
        return ("mxfp4", (1, 32)) if w.shape[1] % 32 == 0 else ("fp8", (32, 32))
    if any(p in name for p in (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.",
                               ".shared_experts.", ".main_proj.")):
        return "fp8", (128, 128) if name.startswith("mtp.1.") else (32, 32)
    return None


@pytest.mark.parametrize("mode", ["native", "dequantize"])
def test_released_format_drafter_equals_its_dequantized_twin(checkpoint, sequence, tmp_path, monkeypatch, mode):
    """The drafter as released, kept as stored (``native``: its layers run the packed ops on the stored tensors)
    or dequantized at load, against the checkpoint saved dequantized."""
    from deepinfer.quant import QuantizedTensor
    from tests.support.quantized import quantize_checkpoint

    quantized, dequantized = quantize_checkpoint(checkpoint[0], tmp_path, released_layout,
                                                 quantization_config={"quant_method": "fp8", "expert_dtype": "fp4"})
    monkeypatch.setenv("DEEPINFER_QUANTIZED_WEIGHTS", mode)
    outs = []
    for folder in (quantized, dequantized):
        model = load_model(folder, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
        stored = folder == quantized and mode == "native"
        feats = captured(model, sequence, [60])
        drafter = drafter_for(model, feats, [30], [0])
        assert isinstance(drafter.main_proj, QuantizedTensor) == stored
        assert isinstance(drafter.layers[0].attn.wo_b, QuantizedTensor) == stored
        with torch.no_grad():
            at = [DraftRequest(slot_state(0), int(sequence[30]), 30, 0.0, 0, 0)]
            outs.append(drafter.block(at, SPEC.block_size))
    assert float((outs[0][0] - outs[1][0]).abs().max()) <= TOL
    assert float((outs[0][1] - outs[1][1]).abs().max()) <= TOL


def test_bf16_load_keeps_the_confidence_head_and_norms_in_fp32(checkpoint):
    model = load_model(checkpoint[0], ops=OpTable(), dtype=torch.bfloat16, device=torch.device("cpu"))
    from deepinfer.models.checkpoint import SafetensorsCheckpoint

    layers, stored = model.dspark, SafetensorsCheckpoint(checkpoint[0])
    head = stored.get("mtp.1.confidence_head.proj.weight")
    assert head.dtype == torch.float32 and torch.equal(layers.confidence.weight, head)  # not through bf16
    assert layers.main_norm.dtype == torch.float32 and layers.layers[0].attn_hc.fn.dtype == torch.float32
    assert layers.layers[0].attn.w_in.weights[0].dtype == torch.bfloat16
    drafter = DSparkDrafter.from_model(model, num_slots=1)
    drafts = drafter.draft([DraftRequest(slot_state(0), 5, 0, 0.0, 0, 0)], SPEC.block_size)
    assert drafts.confidence.dtype == torch.float32 and bool(((drafts.confidence > 0) & (drafts.confidence < 1)).all())
