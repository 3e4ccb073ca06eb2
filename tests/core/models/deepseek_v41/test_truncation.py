"""Decoder prefill truncation (DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact): the decoder runs on a prompt's last
KEEP positions only.  It must equal an independent dense reference that does the same (tools.train.v41_dense,
``decoder_keep``), whole, chunked and continued by decoding; a request that asks for prompt logprobs gets the full
prefill; and a KEEP below the window and the drafter's look-back is refused at start-up, naming the bound."""

from __future__ import annotations

import pytest
import torch

from deepinfer.models import ForwardBatch, load_model
from deepinfer.ops import OpTable
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)
from tests.support.v41_fixtures import FIXTURES, references
from tools.train import v41_dense

KEEP = 40  # tiny_b: window 24, no drafter -> bound 24


def _load(monkeypatch, keep: int | None):
    if keep is not None:
        monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
        monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", str(keep))
    model = load_model(FIXTURES / "tiny_b", ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", raising=False)
    return model


@pytest.fixture(scope="module")
def dense():
    return v41_dense.load(FIXTURES / "tiny_b")


def _feed(model, state, tokens: torch.Tensor, chunks: list[int], needed: int) -> list[torch.Tensor]:
    """Logits of each chunk, every chunk telling the model that only position ``needed`` on is read."""
    out, start = [], 0
    with torch.no_grad():
        for n in chunks:
            ids = tokens[start : start + n]
            batch = ForwardBatch(ids, torch.arange(start, start + n), [n], [state], needed_from=[needed])
            out.append(model.compute_logits(model.forward(batch)))
            start += n
    return out


def test_truncated_prefill_equals_the_dense_reference(monkeypatch, dense):
    model = _load(monkeypatch, KEEP)
    for ref in references("tiny_b")[:2]:  # 300 and 64 tokens: both longer than KEEP
        tokens, n = ref.tokens, len(ref.tokens)
        with torch.no_grad():
            expected = dense(tokens[None], decoder_keep=KEEP)[0]  # the kept rows' logits
        # whole; the kept rows split over two chunks; a chunk boundary before the floor and one after it
        for chunks in ([n], [n - 30, 30], [n - KEEP - 5, 20, KEEP - 15]):
            logits = torch.cat(_feed(model, model.new_state(), tokens, chunks, n - 1))
            torch.testing.assert_close(logits[n - KEEP :], expected, atol=1e-4, rtol=0)


def test_decoding_after_a_truncated_prefill(monkeypatch, dense):
    """Greedy tokens after the truncated prefill: each step's logits equal the dense reference over prompt and
    generated tokens with the same decoder floor."""
    model = _load(monkeypatch, KEEP)
    tokens = references("tiny_b")[1].tokens
    state, n = model.new_state(), len(tokens)
    logits = _feed(model, state, tokens, [n], n - 1)[0][-1]
    generated: list[int] = []
    with torch.no_grad():
        for step in range(6):
            generated.append(int(logits.argmax()))
            seq = torch.cat([tokens, torch.tensor(generated)])
            expected = dense(seq[None], decoder_keep=KEEP + step + 1)[0][-1]
            batch = ForwardBatch(seq[-1:], torch.tensor([n + step]), [1], [state], needed_from=[n + step])
            logits = model.compute_logits(model.forward(batch))[0]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_prompt_logprobs_get_the_full_prefill(monkeypatch):
    """needed_from = 0 (the engine's value when prompt logprobs are asked for): every row, as without truncation."""
    truncated, full = _load(monkeypatch, KEEP), _load(monkeypatch, None)
    tokens = references("tiny_b")[0].tokens
    a = _feed(truncated, truncated.new_state(), tokens, [len(tokens)], 0)[0]
    b = _feed(full, full.new_state(), tokens, [len(tokens)], 0)[0]
    assert torch.equal(a, b)


def test_truncated_rows_really_differ_from_the_full_prefill(monkeypatch):
    """The kept rows near the floor see shorter windows: truncation is approximate through stacked SWA layers."""
    truncated, full = _load(monkeypatch, KEEP), _load(monkeypatch, None)
    tokens = references("tiny_b")[0].tokens
    n = len(tokens)
    a = _feed(truncated, truncated.new_state(), tokens, [n], n - 1)[0]
    b = _feed(full, full.new_state(), tokens, [n], n - 1)[0]
    assert float((a[n - KEEP] - b[n - KEEP]).abs().max()) > 1e-2  # the floor's row sees only itself
    assert bool((a[: n - KEEP] == 0).all())  # no decoder output before the floor


def test_keep_below_the_bound_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=23 is below this model's bound 24"):
        _load(monkeypatch, 23)


def test_the_engine_truncates_prompts_but_not_scored_ones(monkeypatch):
    """Through LLM.generate: a plain request's first token and its logprobs are the truncated model's (the prefill
    in chunks that cross the floor, fed the engine's needed_from); a request with prompt_logprobs gets the full
    prefill's logprobs."""
    from deepinfer import LLM, SamplingParams

    tokens = references("tiny_b")[0].tokens[:120]
    n = len(tokens)
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", str(KEEP))
    llm = LLM(str(FIXTURES / "tiny_b"), dtype="float32", max_num_batched_tokens=50)
    params = [SamplingParams(temperature=0, max_tokens=1, logprobs=5),
              SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)]
    plain, scored = llm.generate([tokens.tolist()] * 2, params, use_tqdm=False)
    truncated, full = _load(monkeypatch, KEEP), _load(monkeypatch, None)
    last = {name: torch.log_softmax(_feed(m, m.new_state(), tokens, [n], n - 1)[0][-1], dim=-1)
            for name, m in (("truncated", truncated), ("full", full))}
    token = plain.outputs[0].token_ids[0]
    got = torch.tensor([plain.outputs[0].logprobs[0][t].logprob for t in sorted(plain.outputs[0].logprobs[0])])
    ids = torch.tensor(sorted(plain.outputs[0].logprobs[0]))
    assert token == int(last["truncated"].argmax())
    torch.testing.assert_close(got, last["truncated"][ids], atol=1e-4, rtol=0)
    assert float((last["truncated"] - last["full"]).abs().max()) > 1e-3  # the truncation made a difference
    want = torch.log_softmax(_feed(full, full.new_state(), tokens, [n], 0)[0], dim=-1)
    got = torch.tensor([scored.prompt_logprobs[i][int(t)].logprob for i, t in enumerate(tokens) if i])
    torch.testing.assert_close(got, want[:-1].gather(1, tokens[1:, None]).squeeze(1), atol=1e-4, rtol=0)
