"""tools.bench.dspark on the embedded tiny V4 (no drafter: the tool's stand-in), and forced acceptance: the
benchmark-only mode accepts L - 1 drafts a step on average, so the measured acceptance length is L."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import deepinfer
from deepinfer import LLM, SamplingParams
from deepinfer.spec_decode.budget import SpecPolicy
from tests.support.stand_in_drafter import StandInDrafter
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)

TINY_V4 = Path(deepinfer.__file__).parent / "assets" / "tiny_v4"


def _tool():
    from tools.bench import dspark

    return dspark


def test_forced_acceptance_accepts_the_asked_length_on_average():
    llm = LLM(str(TINY_V4), dtype="float32")
    llm.engine.set_drafter(StandInDrafter(llm.engine.model.vocab_size, 4), SpecPolicy(4), forced_acceptance=2.5)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True),
                       use_tqdm=False)[0]
    stats = out.spec_decoding_stats
    assert stats.num_drafts == 12 and stats.mean_acceptance_length == 2.5  # 1 + 12 * 2.5 = 31 tokens
    assert len(out.outputs[0].token_ids) == 31


def test_bench_dspark_reports_forced_and_real_rows(tmp_path):
    out = tmp_path / "rows.json"
    assert _tool().main(["--model", str(TINY_V4), "--batches", "2", "--acceptance", "2.5,4", "--real",
                         "--new-tokens", "11", "--prompt-len", "8", "--repeats", "1", "--dtype", "float32",
                         "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["plain", "forced", "forced", "real"]
    assert all(r["batch"] == 2 and r["tokens_per_s"] > 0 for r in rows)
    assert abs(rows[1]["acceptance"] - 2.5) < 0.4 and rows[2]["acceptance"] > 3.0  # (the end caps the drafts)
    for r in rows:
        if r["mode"] == "real":
            assert r["acceptance"] < 1.5  # arbitrary drafts are (almost) never what the model says


def test_bench_dspark_on_the_tiny_slice_drafts_with_a_random_dspark_drafter(capsys, tmp_path):
    """``--slice --tiny``: the slice target and a DSpark drafter built from random weights (no checkpoint);
    plain decode steps go through the decode graphs, speculative pure-decode steps through the verify graphs."""
    out = tmp_path / "rows.json"
    assert _tool().main(["--slice", "--tiny", "--batches", "2", "--acceptance", "2.5", "--new-tokens", "9",
                         "--prompt-len", "8", "--repeats", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "drafter: DSpark drafter with random weights" in text and "8 routed experts top-3" in text
    plain, forced = json.loads(out.read_text())
    assert (plain["mode"], forced["mode"]) == ("plain", "forced") and abs(forced["acceptance"] - 2.5) < 0.6
    assert 0 < plain["graph_steps"] < plain["steps"] and 0 < forced["graph_steps"] < forced["steps"]
    assert "every layer read the one stack" in text and "as captured verify steps" in text


@pytest.mark.slow  # ~1 min of profiling on the CPU; the test above covers the rest of the tool
def test_bench_dspark_profile_prints_a_plain_and_a_speculative_step(capsys):
    assert _tool().main(["--slice", "--tiny", "--batches", "1", "--acceptance", "3", "--new-tokens", "9",
                         "--prompt-len", "8", "--repeats", "1", "--profile"]) == 0
    text = capsys.readouterr().out
    assert "plain decode step, batch 1, plain:" in text and "speculative decode step, batch 1, L = 3.0:" in text
    assert text.count("| kernel | us / step |") == 2


def test_decode_window_is_one_runs_span_from_first_to_last_token():
    """The decode time is read inside one run (the engine's request metrics), never as the difference of two
    runs' wall times: that difference, mostly prefill on a host-bound model, once reported 14.8x at acceptance
    length 3.86 (at most ~4.9x possible with k = 4)."""
    import time
    from types import SimpleNamespace

    tool = _tool()
    fake = [SimpleNamespace(metrics=SimpleNamespace(first_token_time=10.0, last_token_time=12.5)),
            SimpleNamespace(metrics=SimpleNamespace(first_token_time=10.2, last_token_time=13.0))]
    assert tool.decode_window(fake) == 3.0
    llm = LLM(str(TINY_V4), dtype="float32")
    began = time.time()
    outs = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
                        use_tqdm=False)
    wall = time.time() - began
    assert 0 < tool.decode_window(outs) < wall
