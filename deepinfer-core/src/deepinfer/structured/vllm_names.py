"""vLLM's names for structured output, translated to ``so_args`` (``docs/structured_output.md``).

Offline: ``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))``.  Server: the request field
``structured_outputs`` (``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``) or the older
``guided_json`` / ``guided_regex`` / ``guided_grammar`` / ``guided_choice``.  ``grammar`` is EBNF (xgrammar's,
root rule ``root``); ``choice`` becomes a grammar of its strings; ``json_object`` any JSON object.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}


class StructuredOutputsError(ValueError):
    """A structured-output request that cannot be used; ``field`` is the request field at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a schema, dict or text), ``regex``,
    ``choice`` (a list of strings), ``grammar`` (EBNF) or ``json_object=True``."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def to_so_args(self, where: str = "structured_outputs") -> dict[str, Any]:
        """The same constraint as ``so_args``; raises :class:`StructuredOutputsError` naming ``where``."""
        given = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, False)}
        if len(given) != 1:
            raise StructuredOutputsError(where, f"{where} must set exactly one of json, regex, choice, grammar, "
                                         f"json_object; got {sorted(given) or 'none'}")
        (kind, value), = given.items()
        if kind == "json":
            return {"json_schema": value}
        if kind == "regex":
            return {"regex": value}
        if kind == "grammar":
            return {"ebnf": value}
        if kind == "json_object":
            return {"json_schema": {"type": "object"}}
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise StructuredOutputsError(where, f"{where}.choice must be a non-empty list of non-empty strings, "
                                         f"got {value!r:.80}")
        return {"ebnf": "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)}


def from_mapping(value: Any, where: str = "structured_outputs") -> StructuredOutputsParams:
    """A request's ``structured_outputs`` object (unknown keys refused)."""
    if not isinstance(value, Mapping):
        raise StructuredOutputsError(where, f"{where} must be an object, got {type(value).__name__}")
    known = {f.name for f in fields(StructuredOutputsParams)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise StructuredOutputsError(where, f"{where} has unknown key(s) {unknown}; it takes {sorted(known)}")
    return StructuredOutputsParams(**dict(value))


def request_so_args(request: Any) -> dict[str, Any] | None:
    """The ``so_args`` of a request's ``so_args``, ``structured_outputs`` or ``guided_*`` field (at most one)."""
    sources: dict[str, dict[str, Any]] = {}
    if getattr(request, "so_args", None) is not None:
        sources["so_args"] = request.so_args
    if getattr(request, "structured_outputs", None) is not None:
        sources["structured_outputs"] = from_mapping(request.structured_outputs).to_so_args()
    for name, key in _GUIDED.items():
        if getattr(request, name, None) is not None:
            sources[name] = StructuredOutputsParams(**{key: getattr(request, name)}).to_so_args(name)
    if len(sources) > 1:
        names = sorted(sources)
        raise StructuredOutputsError(names[1], f"give one structured-output field, got {names}")
    return next(iter(sources.values()), None)
