"""``deepinfer``: the command line.  ``deepinfer serve [MODEL]`` starts the OpenAI-compatible server;
``deepinfer bench offline|serve`` measures throughput and latency (``docs/serving.md``)."""

from __future__ import annotations

import argparse
import sys

from deepinfer.entrypoints.engine_flags import add_engine_args, engine_kwargs
from deepinfer.entrypoints.openai.serve_flags import add_chat_args, add_noop_args, chat_template_arg, check_noop_args


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", description=__doc__)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: MODEL as given, else the checkpoint's directory)")
    add_chat_args(p)
    add_noop_args(p)
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    from deepinfer.bench.cli import add_bench_parser

    add_bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        from deepinfer.engine.args import EngineArgs
        from deepinfer.entrypoints.openai.api_server import run_server

        kwargs = engine_kwargs(args)
        try:  # a bad value fails here, in one line, before anything loads
            engine_args = EngineArgs.from_kwargs(kwargs, caller="deepinfer serve")
            chat_template_arg(args.chat_template)
        except (TypeError, ValueError) as exc:
            parser.error(str(exc))
        check_noop_args(args, parser)
        if max(engine_args.data_parallel_size, engine_args.expert_parallel_size,
               engine_args.context_parallel_size) > 1:
            parser.error("deepinfer serve runs one rank; the parallel sizes are for LLM.generate (docs/parallel.md)")
        run_server(args, kwargs)
    else:
        args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
