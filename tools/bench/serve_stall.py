"""How much one huge prompt stalls the other streams of a running ``deepinfer serve``.

Streams one long completion; once it runs, posts a ``--megabytes`` text prompt (refused after tokenizing when it
is longer than ``max_model_len``) and prints how long that request took, how many chunks the stream received
meanwhile and the longest gap between them, beside the stream's median gap before.

    deepinfer serve --dtype float32 --max-model-len 8192 &      # the embedded model on the CPU
    python -m tools.bench.serve_stall --url http://127.0.0.1:8000 --megabytes 2

(With the embedded model's default ``max_model_len`` of a million tokens the prompt is not refused but prefilled,
which on a CPU takes more memory than a development machine has.)  ``tests/e2e/test_serve_hardening.py`` runs it.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

SENTENCE = "Once upon a time, a little cat sat on the mat and looked at the sun. "


@dataclass(slots=True)
class Stall:
    """The big request's answer and duration; the stream's chunks meanwhile, its longest gap, its median before."""

    status: int
    body: Any
    took: float
    chunks: int
    longest_gap: float
    median_gap_before: float


def _stream(url: str, stop: threading.Event, times: list[float]) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=600) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
            if stop.is_set():
                return


def measure(url: str, megabytes: float) -> Stall:
    prompt = SENTENCE * int(megabytes * 1e6 / len(SENTENCE))
    stop, times = threading.Event(), []
    streamer = threading.Thread(target=_stream, args=(url, stop, times), daemon=True)
    streamer.start()
    deadline = time.monotonic() + 120
    while len(times) < 20:
        if time.monotonic() > deadline or not streamer.is_alive():
            raise RuntimeError("the stream did not start")
        time.sleep(0.01)
    before = statistics.median(b - a for a, b in zip(times[-15:], times[-14:], strict=False))
    start = time.monotonic()
    response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=600)
    took = time.monotonic() - start
    stop.set()
    streamer.join(60)
    marks = [start, *(t for t in times if start <= t <= start + took), start + took]
    gap = max(b - a for a, b in zip(marks, marks[1:], strict=False))
    return Stall(response.status_code, response.json(), took, len(marks) - 2, gap, before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--megabytes", type=float, default=2.0)
    args = parser.parse_args()
    s = measure(args.url, args.megabytes)
    print(f"{args.megabytes} MB prompt: HTTP {s.status} after {s.took:.1f} s; the stream got {s.chunks} chunks "
          f"meanwhile, longest gap {s.longest_gap:.2f} s (median gap before: {s.median_gap_before:.3f} s)")


if __name__ == "__main__":
    main()
