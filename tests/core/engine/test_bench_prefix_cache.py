"""``tools.bench.prefix_cache --slice --tiny``: the V4.1-Flash slice (random weights, the shared expert stack)
served by fresh engines through ``LLM.from_model``, with and without the prefix cache, at toy dims on the CPU.
The GPU run (``--slice``, the real dims) is the lead's; this keeps the script from rotting in between."""

from __future__ import annotations

from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)
from tools.bench import prefix_cache as bench


def test_the_tiny_slice_hits_the_shared_prefix_and_replays_its_bound(monkeypatch, capsys):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    result = bench.main(["--slice", "--tiny", "--prefix", "160", "--suffix", "8", "--concurrency", "3",
                         "--repeats", "1"])
    out = capsys.readouterr().out
    assert result["cached"] == 3 * 160 and result["prompt"] == 3 * 168  # every request hits the whole prefix
    assert result["same"] and result["max_diff"] < 1e-2  # exact up to bf16 rounding of other batch shapes
    # 8 layers x (window 16 - 1) + the 4-gram history: each request computes its last 168 - 36 tokens
    assert "replay lookback 124 tokens" in out and "computes from position 36: 132 of each request's 168" in out
    assert "every layer read the one stack of 17 experts" in out  # 16 routed + the shared one, through the engine
