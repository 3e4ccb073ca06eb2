"""Prefix caching (docs/prefix_caching.md): a request served from the cache gives the logprobs it gets from scratch.

The tiny V4 (ratios 4 and 128: blocks of 128 tokens, replay look-back 155) and V4.1 (ratios 2 and 1, Engram:
blocks of 16, look-back 282) assets in fp32.  A warm-up request publishes a shared prefix; the request under test
shares it up to a point inside a compression window, at a block boundary, or just past it, with a suffix that
ends inside the SWA window of the hit or beyond it.  A negative control replays too little and must differ.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.kv.pool import StatePool
from deepinfer.kv.prefix_cache import PrefixCache
from deepinfer.kv.spec import KVBuffer, PageBuffer, SlotBuffer, StateSpec
from deepinfer.models.pooled import PooledCausalLM
from tests.support.tiny_assets import TINY_V4_DIR, TINY_V41_DIR

#: (asset, block size, a block boundary past the replay look-back)
MODELS = {"v4": (TINY_V4_DIR, 128, 384), "v41": (TINY_V41_DIR, 16, 320)}
TOL = 1e-5
BUDGET = 64 << 20


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _logprobs(out) -> list[float]:
    return [e[t].logprob for c in out.outputs for e, t in zip(c.logprobs, c.token_ids, strict=True)]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True, **kw)


def _scratch(path, prompts, params, **kw):
    llm = LLM(str(path), dtype="float32", state_cache_bytes=BUDGET, **{"enable_prefix_caching": False, **kw})
    return [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]


def _cached(path, warm, prompts, params, **kw):
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=True, **{"state_cache_bytes": BUDGET, **kw})
    llm.generate([{"prompt_token_ids": warm}], _greedy(), use_tqdm=False)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_close(ref, out, tol=TOL):
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    diff = max(abs(a - b) for a, b in zip(_logprobs(ref), _logprobs(out), strict=True))
    assert diff <= tol, f"logprobs differ by {diff:.3g}"


# --------------------------------------------------------------------------------------------------
# The cache alone, over a growable pool
# --------------------------------------------------------------------------------------------------


def _pool() -> StatePool:
    spec = StateSpec(4, (KVBuffer("kv", 1, 2, 3), PageBuffer("keys", 2, 2), SlotBuffer("carry", (2,))), page_size=4)
    return StatePool.growable_pool(spec, torch.float32, torch.device("cpu"))


def test_blocks_are_shared_reference_counted_and_evicted_lru():
    pool = _pool()
    cache = PrefixCache(pool, 16)
    tokens = list(range(40))
    a = pool.new_state()
    pool.reserve(a, 40)
    pool.tensors["keys"][:] = torch.arange(pool.tensors["keys"].numel()).view(-1, 2).float()
    cache.publish(a, tokens, 40)
    assert len(cache) == 2 and cache.match(tokens + [7], 40) == 32
    assert cache.match([1] + tokens, 40) == 0  # another first block: no hit
    b = pool.new_state()
    cache.attach(b, tokens, 32, 9)
    # 32 tokens = 16 entries of ratio 2 = four full pages: shared, none copied
    assert b.pages[2] == a.pages[2][:4] and b.num_tokens == 9 and b.cached_tokens == 32
    assert all(pool.holders(2, p) == 4 for p in a.pages[2][:2])  # a, two blocks, b
    a.release()
    b.release()
    assert cache.evict() and len(cache) == 1  # the leaf first
    assert cache.match(tokens, 40) == 16
    cache.clear()
    assert not pool._refs[2] and len(pool._free_pages[2]) == pool.pages[2] - 1


def test_a_partly_filled_page_is_copied_not_shared():
    pool = _pool()
    cache = PrefixCache(pool, 16)  # blocks of 16 tokens: 8 entries, pages of 4 entries
    a = pool.new_state()
    pool.reserve(a, 40)
    pool.tensors["keys"][:] = torch.randn(pool.tensors["keys"].shape)
    cache.publish(a, list(range(40)), 40)
    cache.block_size = 12  # a hit of 12 tokens: 6 entries, one page and a half
    b = pool.new_state()
    pool.attach(b, {2: a.pages[2]}, 12)
    assert b.pages[2][0] == a.pages[2][0] and b.pages[2][1] != a.pages[2][1]
    keys = pool.tensors["keys"]
    assert torch.equal(keys[b.pages[2][1] * 4 : b.pages[2][1] * 4 + 2], keys[a.pages[2][1] * 4 : a.pages[2][1] * 4 + 2])


# --------------------------------------------------------------------------------------------------
# Engine: cached equals computed
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["v4", "v41"])
@pytest.mark.parametrize("where", ["boundary", "inside_window", "past_boundary"])
@pytest.mark.parametrize("suffix", [5, 40])
def test_cached_request_matches_scratch(model, where, suffix):
    path, block, base = MODELS[model]
    # past_boundary: a hit one block further, whose entries of ratio 128 (V4) / 2 (V4.1) end inside a page
    shared_len = {"boundary": base, "inside_window": base + 1, "past_boundary": base + block + block // 2 + 3}
    hit = base + block if where == "past_boundary" else base  # the last block boundary both prompts share
    shared = _tokens(shared_len[where], 1)
    warm, prompt = shared + _tokens(9, 2), shared + _tokens(suffix, 3)
    ref = _scratch(path, [prompt], _greedy())[0]
    llm, (out,) = _cached(path, warm, [prompt], _greedy())
    assert out.num_cached_tokens == hit
    _assert_close(ref, out)


def test_replaying_too_little_differs(monkeypatch):
    """Negative control: a replay of one window rebuilds the first layer's ring only."""
    path, block, _ = MODELS["v41"]
    shared = _tokens(20 * block, 1)
    prompt = shared + _tokens(5, 3)
    ref = _scratch(path, [prompt], _greedy())[0]
    monkeypatch.setattr(PooledCausalLM, "replay_lookback", property(lambda self: self.config.sliding_window))
    _, (out,) = _cached(path, shared + _tokens(9, 2), [prompt], _greedy())
    assert out.num_cached_tokens > 0
    diff = max(abs(a - b) for a, b in zip(_logprobs(ref), _logprobs(out), strict=False))
    assert diff > 1e-3 or [c.token_ids for c in out.outputs] != [c.token_ids for c in ref.outputs]


def test_hit_with_n_completions_and_seeded_sampling():
    path, block, _ = MODELS["v41"]
    shared = _tokens(20 * block, 4)
    prompt = shared + _tokens(11, 5)
    params = SamplingParams(temperature=0.9, n=3, seed=11, max_tokens=6, logprobs=2, ignore_eos=True)
    ref = _scratch(path, [prompt], params)[0]
    _, (out,) = _cached(path, shared + _tokens(3, 6), [prompt], params)
    assert out.num_cached_tokens == 20 * block
    _assert_close(ref, out)


@pytest.mark.slow
def test_hits_under_preemption_match_scratch(monkeypatch):
    """Many requests sharing a prefix in a budget that forces preemption: recomputed ones hit the cache again.
    Batch invariant, so a batched reference (fast) must match bitwise."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    path, block, _ = MODELS["v41"]
    shared = _tokens(20 * block, 7)
    prompts = [shared + _tokens(4 + i, 20 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=100, logprobs=2, ignore_eos=True)
    ref_llm = LLM(str(path), dtype="float32", state_cache_bytes=BUDGET, enable_prefix_caching=False)
    refs = ref_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    small = int(ref_llm.engine.model.state_bytes(len(prompts[0]) + 24) * 3.4)
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=True, state_cache_bytes=small, max_num_seqs=4)
    llm.generate([{"prompt_token_ids": shared + [9]}], _greedy(), use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    assert all(o.num_cached_tokens > 0 for o in outs)
    for ref, out in zip(refs, outs, strict=True):
        _assert_close(ref, out, tol=0.0)


@pytest.mark.parametrize("model", ["v4", "v41"])
def test_bitwise_with_batch_invariance(model, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    path, block, base = MODELS[model]
    shared = _tokens(base + 5, 8)
    prompts = [shared + _tokens(6, 9), shared + _tokens(30, 10)]
    refs = _scratch(path, prompts, _greedy())
    _, outs = _cached(path, shared + _tokens(2, 11), prompts, _greedy())
    for ref, out in zip(refs, outs, strict=True):
        assert out.num_cached_tokens == base
        _assert_close(ref, out, tol=0.0)


def test_prompt_logprobs_requests_compute_their_prompt():
    path, block, _ = MODELS["v41"]
    shared = _tokens(20 * block, 12)
    prompt = shared + _tokens(5, 13)
    params = _greedy(prompt_logprobs=1)
    _, (out,) = _cached(path, shared + [3], [prompt], params)
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)


def test_cache_off_reports_nothing():
    path, *_ = MODELS["v41"]
    llm = LLM(str(path), dtype="float32", state_cache_bytes=BUDGET, enable_prefix_caching=False)
    assert llm.engine.state_cache.prefix is None
    out = llm.generate([{"prompt_token_ids": _tokens(40, 1)}], _greedy(), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert llm.reset_prefix_cache() is False


@pytest.mark.parametrize("suffix", [5, 200])
def test_decoder_truncation_and_the_cache_agree(monkeypatch, suffix):
    """V4.1 with decoder prefill truncation: a hit replays from below the decoder's floor, so the served request
    equals the truncated prefill from scratch (the decoder's approximate rings are never cached)."""
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "48")
    path, block, base = MODELS["v41"]
    shared = _tokens(base + 2 * block, 14)
    prompt = shared + _tokens(suffix, 15)
    ref = _scratch(path, [prompt], _greedy())[0]
    _, (out,) = _cached(path, shared + _tokens(4, 16), [prompt], _greedy())
    assert out.num_cached_tokens == base + 2 * block
    _assert_close(ref, out)


def test_server_metrics_report_the_hit_rate():
    import asyncio

    from deepinfer.engine.async_llm import AsyncLLM
    from deepinfer.entrypoints.openai.metrics import render
    from tests.support.server import metric_key, parse_metrics

    path, block, base = MODELS["v41"]
    shared = _tokens(base, 17)
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=True, state_cache_bytes=BUDGET)
    engine = AsyncLLM(llm)
    try:
        async def one(prompt, rid):
            async for out in engine.generate({"prompt_token_ids": prompt}, _greedy(), rid):
                last = out
            return last

        first = asyncio.run(one(shared + [5, 6], "a"))
        second = asyncio.run(one(shared + [7, 8, 9], "b"))
    finally:
        engine.shutdown()
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, base)
    stats = engine.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (2 * base + 5, base)
    m = parse_metrics(render(stats, "m"))
    assert m[metric_key("deepinfer:prefix_cache_hits_total", model_name="m")] == base
    assert m[metric_key("deepinfer:prefix_cache_hit_rate", model_name="m")] == pytest.approx(base / (2 * base + 5))


def test_a_model_without_a_pooled_state_is_refused():
    from tests.support.toy_model import ToyCausalLM, toy_tokenizer

    tok = toy_tokenizer()
    with pytest.raises(ValueError, match="enable_prefix_caching=True: ToyCausalLM has no prefix cache"):
        LLM.from_model(ToyCausalLM(len(tok), seed=1), tok, enable_prefix_caching=True)


def test_prefix_caching_is_on_by_default_where_a_model_has_a_prefix_cache():
    """The default (None): on for V4 / V4.1 on one rank, off (no error) for a model without a pooled state."""
    from tests.support.toy_model import ToyCausalLM, toy_tokenizer

    assert LLM(str(TINY_V41_DIR), dtype="float32", state_cache_bytes=BUDGET).engine.config.enable_prefix_caching
    assert not LLM(str(TINY_V41_DIR), dtype="float32", state_cache_bytes=BUDGET,
                   enable_prefix_caching=False).engine.config.enable_prefix_caching
    tok = toy_tokenizer()
    assert not LLM.from_model(ToyCausalLM(len(tok), seed=1), tok).engine.config.enable_prefix_caching


def test_a_preempted_request_hits_its_own_prompt_again():
    """Fast counterpart of the budget-driven test: preempt a decoding request by hand; its recompute starts from
    the cache (the blocks its own prefill published) and the output is unchanged."""
    path, block, base = MODELS["v41"]
    prompt = _tokens(base + 7, 18)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    ref = _scratch(path, [prompt], params)[0]
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=True, state_cache_bytes=BUDGET)
    engine = llm.engine
    assert engine.add_request({"prompt_token_ids": prompt}, params, "r") is None
    seq = engine.requests["r"].sequences[0]
    while seq.num_output < 4:
        engine.step()
    engine.drain()
    assert seq.num_cached == 0  # the first prefill found nothing
    engine.scheduler._preempt(seq)
    engine.state_cache.free(seq.seq_id)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    done += engine.drain()
    (out,) = done
    assert engine.num_preemptions == 1 and out.num_cached_tokens == base
    _assert_close(ref, out)


def test_a_full_pool_evicts_the_least_recently_used_prefixes():
    path, block, base = MODELS["v41"]
    prompts = [_tokens(base + 3, 30 + i) for i in range(6)]
    ref_llm = LLM(str(path), dtype="float32", state_cache_bytes=BUDGET)
    small = int(ref_llm.engine.model.state_bytes(base + 40) * 3)
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=True, state_cache_bytes=small, max_num_seqs=2)
    cache = llm.engine.state_cache.prefix
    for p in prompts:
        llm.generate([{"prompt_token_ids": p}], _greedy(), use_tqdm=False)
    assert 0 < len(cache) < 6 * (base // block)  # the pool could not keep every prefix
    assert cache.match(prompts[0], base) == 0 and cache.match(prompts[-1], base) == base
    again = llm.generate([{"prompt_token_ids": prompts[-1] + [4]}], _greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens == base
    assert llm.reset_prefix_cache() and len(cache) == 0  # every block dropped: the next request computes it all
    assert llm.generate([{"prompt_token_ids": prompts[-1] + [5]}], _greedy(), use_tqdm=False)[0].num_cached_tokens == 0
    _assert_close(ref_llm.generate([{"prompt_token_ids": prompts[-1] + [4]}], _greedy(), use_tqdm=False)[0], again)


def _run(engine, prompts, params) -> list:
    for i, p in enumerate(prompts):
        assert engine.add_request({"prompt_token_ids": p}, params, f"q{i}") is None
    done = []
    while engine.has_unfinished():
        done += engine.step()
    return sorted(done + engine.drain(), key=lambda o: o.request_id)


def test_hits_count_once_per_admitted_sequence_not_per_lookup():
    """A sequence that waits for state budget is looked up at every step; the counters take its lookup once, when
    it is admitted, with the hit it starts from (so hits == the requests' num_cached_tokens)."""
    path, block, base = MODELS["v41"]
    shared = _tokens(base, 40)
    prompts = [shared + _tokens(5, 41), shared + _tokens(7, 42)]
    probe = LLM(str(path), dtype="float32", state_cache_bytes=BUDGET, enable_prefix_caching=False)
    one = int(probe.engine.model.state_bytes(len(prompts[1]) + 30) * 2.5)  # room for one sequence at a time
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=True, state_cache_bytes=one)
    llm.generate([{"prompt_token_ids": shared + [9]}], _greedy(), use_tqdm=False)
    stats = llm.engine.state_cache.prefix.stats
    before = (stats.queries, stats.query_tokens, stats.hit_tokens)
    lookups, lookup = [], llm.engine.scheduler.prefix_lookup
    llm.engine.scheduler.prefix_lookup = lambda seq: lookups.append(seq.seq_id) or lookup(seq)
    outs = _run(llm.engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert len(lookups) > 2  # the second request was looked up while it waited
    assert llm.engine.num_preemptions == 0 and [o.num_cached_tokens for o in outs] == [base, base]
    assert (stats.queries - before[0], stats.query_tokens - before[1], stats.hit_tokens - before[2]) == (
        2, sum(map(len, prompts)), 2 * base)


def test_a_hit_the_step_cannot_replay_is_not_counted():
    """With a token budget smaller than the replay, the scheduler computes the prompt from scratch: 0 hits."""
    path, block, base = MODELS["v41"]
    shared = _tokens(base, 43)
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=True, state_cache_bytes=BUDGET,
              max_num_batched_tokens=64)
    llm.generate([{"prompt_token_ids": shared + [9]}], _greedy(), use_tqdm=False)
    cache = llm.engine.state_cache.prefix
    assert cache.match(shared + [3], base) == base  # it is cached, but its replay needs more than 64 tokens
    hits = cache.stats.hit_tokens
    (out,) = _run(llm.engine, [shared + [3, 4]], _greedy())
    assert out.num_cached_tokens == 0 and cache.stats.hit_tokens == hits
