"""On the GPU: DSpark draft passes captured as CUDA graphs (``runner/draft_graphs.py``), greedy and sampled, replay
what the eager pass computes.  The embedded tiny V4.1 with its trained drafter in bf16 on the CUDA op table.  A
replay equals an eager ``draft_forward`` on the same padded rows bit for bit (same kernels, same shapes); against
the unpadded eager ``draft`` the tokens agree and the confidences are close (a GEMM's reduction order may change
with the row count).  Through the engine (``DEEPINFER_USE_NEXTN_DECODE=4``), greedy output with captured drafts
equals plain decoding, and a seeded sampled run replays captured sampled draft passes and repeats exactly.
Skipped on CPU-only machines."""

from __future__ import annotations

import pytest
import torch

from deepinfer.spec_decode.drafter import DraftRequest
from tests.support.tiny_assets import TINY_V41_DIR
from tools.train.dspark_accept import slot_state

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host: pytest tests/backend_cuda")
pytestmark = [requires_cuda, pytest.mark.cuda]


@pytest.fixture(scope="module")
def drafter():
    from deepinfer.models import load_model
    from deepinfer.models.deepseek_v41.dspark import DSparkDrafter
    from deepinfer.ops import OpTable
    from deepinfer_cuda.plugin import CudaBackend

    backend = CudaBackend()
    ops = OpTable(backend.load_ops(), "nvidia", coverage=backend.op_coverage())
    model = load_model(TINY_V41_DIR, ops=ops, dtype=torch.bfloat16, device=torch.device("cuda"))
    drafter = DSparkDrafter.from_model(model, num_slots=16)
    gen = torch.Generator().manual_seed(0)
    width = len(drafter.capture_layer_ids) * model.config.hidden_size
    for slot, length in [(1, 40), (2, 7), (4, 200), (5, 13), (6, 64), (7, 90)]:
        feats = torch.randn(length, width, generator=gen).to("cuda")
        drafter.extend([slot_state(slot)] * length, torch.arange(length, device="cuda"), feats)
    return backend, drafter


def _requests(n: int, shift: int = 0) -> list[DraftRequest]:
    at = [(1, 17, 40), (2, 301, 7), (3, 5, 0), (4, 88, 200), (5, 120, 9), (6, 42, 64), (7, 9, 90)]
    return [DraftRequest(slot_state(slot), anchor + shift, position, 0.0, 0, 0) for slot, anchor, position in at[:n]]


def test_captured_draft_passes_replay_the_eager_pass(drafter):
    from deepinfer.runner.draft_graphs import DraftGraphs

    backend, drafter = drafter
    graphs = DraftGraphs(drafter, backend, torch.device("cuda"), max_seqs=16)
    with torch.inference_mode():
        for k in (drafter.max_draft_len, 2):
            for n, shift in [(1, 0), (3, 0), (5, 0), (7, 0), (3, 11), (1, 4)]:  # later ones replay
                requests = _requests(n, shift)
                captured = graphs.run(requests, k)
                tokens, confidence = captured.tokens.clone(), captured.confidence.clone()
                padded = drafter.draft_inputs(requests, graphs.bucket(n)).to("cuda")
                same_rows = drafter.draft_forward(padded, k, False)
                assert torch.equal(tokens, same_rows.tokens[:n]), (k, n, shift)
                assert torch.equal(confidence, same_rows.confidence[:n]), (k, n, shift)
                eager = drafter.draft(requests, k)
                agree = float((tokens == eager.tokens).float().mean())
                assert agree >= 0.9, (k, n, shift, agree)
                assert float((confidence - eager.confidence).abs().max()) <= 2e-2
    assert graphs.eager_reason is None, graphs.eager_reason  # captured, not the eager fallback
    assert sorted({rows for rows, _, _ in graphs._graphs}) == [1, 4, 8]  # 5 and 7 requests share the 8-row bucket
    graphs.close()


def _mixed(n: int, seed: int = 0) -> list[DraftRequest]:
    """``_requests(n)``, every other one sampled (temperature 0.8 or 1.2, seed ``seed + i``)."""
    temps = [0.8, 0.0, 1.2, 0.0, 0.8, 1.2, 0.0]
    return [DraftRequest(r.state, r.anchor, r.position, temps[i], seed + i, 3 * i) for i, r in enumerate(_requests(n))]


def test_captured_sampled_draft_passes_replay_the_eager_pass(drafter):
    """Sampled passes (counter-based draws, sample_tokens' kernel) captured per (bucket, k): a replay equals the
    eager pass on the same padded rows bit for bit (tokens, confidence), repeats for equal seeds, and mostly
    agrees with the unpadded eager draft."""
    from deepinfer.runner.draft_graphs import DraftGraphs

    backend, drafter = drafter
    graphs = DraftGraphs(drafter, backend, torch.device("cuda"), max_seqs=16)
    with torch.inference_mode():
        for k in (drafter.max_draft_len, 2):
            for n, seed in [(1, 0), (3, 0), (5, 4), (7, 0), (3, 9), (3, 0)]:  # later ones replay
                requests = _mixed(n, seed)
                captured = graphs.run(requests, k)
                tokens = captured.tokens.clone()
                confidence = captured.confidence.clone()
                padded = drafter.draft_inputs(requests, graphs.bucket(n)).to("cuda")
                same_rows = drafter.draft_forward(padded, k, True)
                assert torch.equal(tokens, same_rows.tokens[:n]), (k, n, seed)
                assert torch.equal(confidence, same_rows.confidence[:n]), (k, n, seed)
                assert torch.equal(graphs.run(requests, k).tokens, tokens), (k, n, seed)  # seeded: repeats
                eager = drafter.draft(requests, k)
                agree = float((tokens == eager.tokens).float().mean())
                assert agree >= 0.7, (k, n, seed, agree)
    assert graphs.eager_reason is None, graphs.eager_reason
    assert {key for key in graphs._graphs if key[2]} == {(b, k, True) for k in (2, drafter.max_draft_len)
                                                          for b in (1, 4, 8)}
    graphs.close()


def test_engine_greedy_output_with_captured_drafts_and_verify_steps_is_the_plain_output(monkeypatch):
    from deepinfer import LLM, SamplingParams
    from deepinfer.spec_decode.budget import SpecPolicy

    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "4")
    llm = LLM(str(TINY_V41_DIR), max_num_seqs=8)
    engine = llm.engine
    drafter = engine.drafter
    assert drafter is not None and engine.runner.decode_graphs is not None
    prompts = ["Once upon a time", "One day, a boy", "The cat"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.set_drafter(None)
    plain = llm.generate(prompts, params, use_tqdm=False)
    engine.set_drafter(drafter, SpecPolicy(4))
    spec = llm.generate(prompts, params, use_tqdm=False)
    graphs = engine.runner.draft_graphs
    assert graphs is not None and graphs._graphs and graphs.eager_reason is None, graphs and graphs.eager_reason
    verify = engine.runner.verify_graphs  # the verify steps were captured too (runner/verify_graphs.py)
    assert verify is not None and verify._graphs and verify.eager_reason is None, verify and verify.eager_reason
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.spec_decoding_stats is not None and b.spec_decoding_stats.num_drafts > 0
    # the drafter works: over the run (one prompt's continuation may sit where the tiny drafter is weak -- "The
    # cat" takes another first token on the GPU than on the CPU and accepts 2.2 there, the run 2.96)
    drafts = sum(b.spec_decoding_stats.num_drafts for b in spec)
    assert 1 + sum(b.spec_decoding_stats.num_accepted_tokens for b in spec) / drafts > 2.5  # trained: 4.45 offline


def test_engine_seeded_sampled_run_with_captured_drafts_repeats(monkeypatch):
    """Sampled and greedy requests together: every draft pass is a replayed graph (sampled passes included, no
    eager fallback), the verify steps are captured, and the seeded run repeats token for token."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.spec_decode.budget import SpecPolicy

    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "4")
    llm = LLM(str(TINY_V41_DIR), max_num_seqs=8)
    engine = llm.engine
    drafter = engine.drafter
    assert drafter is not None and engine.runner.decode_graphs is not None
    prompts = ["Once upon a time", "One day, a boy", "The cat", "A little girl named Lily"]
    params = [SamplingParams(temperature=t, top_p=p, max_tokens=24, ignore_eos=True, seed=s)
              for s, t, p in [(1, 1.0, 1.0), (2, 0.0, 1.0), (3, 0.7, 0.9), (4, 1.3, 1.0)]]
    engine.set_drafter(drafter, SpecPolicy(4))
    calls = {"eager": 0}
    eager_draft = drafter.draft

    def counted(*args, **kwargs):
        calls["eager"] += 1
        return eager_draft(*args, **kwargs)

    monkeypatch.setattr(drafter, "draft", counted)
    runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
    graphs = engine.runner.draft_graphs
    assert graphs is not None and graphs.eager_reason is None, graphs and graphs.eager_reason
    assert any(sampled for _, _, sampled in graphs._graphs) and calls["eager"] == 0
    verify = engine.runner.verify_graphs
    assert verify is not None and verify._graphs and verify.eager_reason is None, verify and verify.eager_reason
    for a, b in zip(*runs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.spec_decoding_stats is not None and b.spec_decoding_stats.num_drafts > 0
