"""``so_args``: what a request asks its output to match, validated and put in canonical form.

A request names exactly one grammar: ``{"regex": str}``, ``{"json_schema": dict | str}`` or
``{"ebnf": str}`` (GBNF-style, root rule ``root``).  The canonical form is hashable, so equal
grammars share one compiled entry in the cache however the caller spelled them (a schema given as a
dict and the same schema as a JSON string are one key).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["regex", "json_schema", "ebnf"]

#: The keys ``so_args`` accepts; exactly one must be present.
SO_ARGS_KINDS: tuple[GrammarKind, ...] = ("regex", "json_schema", "ebnf")

_ALLOWED = "exactly one of 'regex' (str), 'json_schema' (dict or JSON string) or 'ebnf' (str, root rule 'root')"


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """One request's grammar: its kind and canonical source text (a JSON schema is re-serialised)."""

    kind: GrammarKind
    source: str


def parse_so_args(so_args: Any) -> GrammarSpec:
    """Validate ``SamplingParams.so_args`` and return its canonical :class:`GrammarSpec`.

    Raises ``ValueError`` naming the offending key and what is allowed.  This checks the form only;
    whether the grammar itself is valid is known when it is compiled (:class:`GrammarCompiler`).
    """
    if isinstance(so_args, GrammarSpec):
        return so_args
    if not isinstance(so_args, dict):
        raise ValueError(f"so_args must be a dict with {_ALLOWED}; got {type(so_args).__name__}")
    unknown = sorted(str(k) for k in so_args if k not in SO_ARGS_KINDS)
    if unknown:
        raise ValueError(f"so_args has unknown key(s) {unknown}; it takes {_ALLOWED}")
    if len(so_args) != 1:
        given = sorted(so_args) or "none"
        raise ValueError(f"so_args must have {_ALLOWED}; got {given}")
    (kind, value), = so_args.items()
    if kind == "json_schema":
        return GrammarSpec("json_schema", _canonical_schema(value))
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"so_args[{kind!r}] must be a non-empty string, got {_describe(value)}")
    return GrammarSpec(kind, value)


def _canonical_schema(value: Any) -> str:
    """The schema as compact JSON.  Key order is kept: it fixes the order of properties in the output.  The
    boolean schemas: ``true`` is ``{}`` (any value); ``false`` admits no value and is refused here."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"so_args['json_schema'] is a string but not valid JSON: {e}") from None
    if value is True:
        value = {}
    if value is False:
        raise ValueError("so_args['json_schema'] is false: the schema admits no value")
    if not isinstance(value, dict):
        raise ValueError(
            f"so_args['json_schema'] must be a JSON schema object (a dict or a JSON string of one), "
            f"got {_describe(value)}"
        )
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"so_args['json_schema'] is not JSON-serialisable: {e}") from None


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
