"""``EngineArgs`` as command-line flags (vLLM's spelling: ``--max-num-seqs``), generated from its fields so the
CLI never falls behind the Python API.  Only flags given on the command line are passed on, so every default
stays the one written in ``EngineArgs``."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from deepinfer.engine.args import EngineArgs

_TYPES: dict[str, Any] = {"int": int, "int | None": int, "float": float}


def _help(name: str) -> str:
    return f"EngineArgs.{name} (docs/engine.md, 'Engine arguments')"


def add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    group = parser.add_argument_group("engine arguments (EngineArgs; docs/engine.md)")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if f.name == "model":
            if model_positional:
                group.add_argument("model", nargs="?", default=argparse.SUPPRESS,
                                   help="checkpoint directory or Hugging Face repo id (default: "
                                        "DEEPINFER_HF_MODEL_DIR, the cached default checkpoint, "
                                        "else the embedded tiny model)")
            else:
                group.add_argument("--model", default=argparse.SUPPRESS, help=_help(f.name))
        elif kind in ("bool", "bool | None"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=_help(f.name))
        else:
            group.add_argument(flag, type=_TYPES.get(kind, str), default=argparse.SUPPRESS, help=_help(f.name))


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineArgs`` keywords given on the command line."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return {k: v for k, v in vars(ns).items() if k in names}
