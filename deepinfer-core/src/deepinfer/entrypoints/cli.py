"""``deepinfer``: the command line.  ``deepinfer serve [MODEL]`` starts the OpenAI-compatible server;
``deepinfer bench offline|serve`` measures throughput and latency (``docs/serving.md``); ``deepinfer plan [MODEL]``
prints the memory plan (``docs/parallel.md``)."""

from __future__ import annotations

import argparse
import sys

from deepinfer.entrypoints.engine_flags import add_engine_args, engine_kwargs
from deepinfer.entrypoints.openai.limits import add_limit_args, limits_from_args
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
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: DEEPINFER_API_KEY, else none)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names the server answers, '*' for any (default: loopback names when "
                        "bound to loopback, else any)")
    add_limit_args(p)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    from deepinfer.bench.cli import add_bench_parser
    from deepinfer.entrypoints.plan import add_plan_parser

    add_bench_parser(sub)
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        from deepinfer.engine.args import EngineArgs
        from deepinfer.entrypoints.openai.api_server import run_server

        kwargs = engine_kwargs(args)
        try:  # a bad value fails here, in one line, before anything loads
            EngineArgs.from_kwargs(kwargs, caller="deepinfer serve")
            limits_from_args(args)
            chat_template_arg(args.chat_template)
        except (TypeError, ValueError) as exc:
            parser.error(str(exc))
        check_noop_args(args, parser)
        run_server(args, kwargs)
    else:
        args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
