"""``deepinfer bench offline`` and ``deepinfer bench serve``: their flags."""

from __future__ import annotations

import argparse
import json

from deepinfer.entrypoints.engine_flags import add_engine_args


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", choices=["random", "file"], default="random",
                   help="random token ids, or windows of --dataset-path's tokens")
    p.add_argument("--dataset-path", default=None, help="a text file (--dataset file)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=32, help="output length in tokens (ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the prompts and arrival times")
    p.add_argument("--result-json", default=None, help="also write the result row to this file")
    p.add_argument("--append", action="store_true", help="append the row to --result-json (JSON lines)")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="throughput / latency benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True)

    offline = kinds.add_parser("offline", help="LLM.generate on a batch of prompts")
    add_engine_args(offline, model_positional=False)
    _common(offline)
    offline.set_defaults(run=_offline)

    serve = kinds.add_parser("serve", help="drive a running server over HTTP")
    _common(serve)
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--served-model-name", default=None, help="default: the server's first model")
    serve.add_argument("--tokenizer", default=None, help="default: the server's model directory (/v1/models root)")
    serve.add_argument("--request-rate", type=float, default=float("inf"),
                       help="requests/s, Poisson (inf: all at once)")
    serve.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    serve.add_argument("--num-devices", type=int, default=1, help="divides the per-device throughputs")
    serve.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    serve.add_argument("--label", default=None, help="tag written into the row as 'phase' (e.g. prefill, decode)")
    serve.add_argument("--extra", type=json.loads, default=None, help="a JSON object merged into the row")
    serve.set_defaults(run=_serve)


def _offline(args: argparse.Namespace) -> None:
    from deepinfer.bench.offline import run_offline

    run_offline(args)


def _serve(args: argparse.Namespace) -> None:
    from deepinfer.bench.serving import run_serving

    run_serving(args)
