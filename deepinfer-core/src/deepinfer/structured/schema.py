"""JSON schemas xgrammar cannot be trusted with: those that admit no value, and output it let through.

xgrammar turns a schema into a grammar, but ignores keywords it does not support (``not`` with a value,
``allOf`` with several members, ...), so a schema that admits nothing may still compile into a grammar that
admits something.  Two guards keep such output from being returned as a valid result:

- before compiling, :func:`empty_schema_reason` finds schemas that admit no JSON value from the keywords that
  decide a value's kind (``type``, ``const``, ``enum``, ``allOf`` / ``anyOf`` / ``oneOf``, ``not``, required
  properties, required items): such a request is rejected;
- after a constrained completion ends, :func:`schema_violation` checks the text with the ``jsonschema``
  validator, which knows every keyword: output that fails the schema fails its request instead.
"""

from __future__ import annotations

import functools
import json
from typing import Any

#: Kinds of JSON value ("number" is integer or fraction; 1.0 is an integer, as JSON Schema says).
ALL_KINDS = frozenset({"null", "boolean", "integer", "fraction", "string", "array", "object"})
_TYPE_KINDS = {"null": {"null"}, "boolean": {"boolean"}, "integer": {"integer"}, "number": {"integer", "fraction"},
               "string": {"string"}, "array": {"array"}, "object": {"object"}}
_MAX_DEPTH = 64


def empty_schema_reason(schema: Any) -> str | None:
    """Why ``schema`` admits no JSON value, or ``None`` if it may admit one (this check is conservative)."""
    if not value_kinds(schema):
        return ("no JSON value satisfies it (its type, const, enum, allOf / anyOf / oneOf, not and required "
                "properties or items exclude every value)")
    return None


def value_kinds(schema: Any, depth: int = 0) -> frozenset[str]:
    """The kinds of JSON value ``schema`` may admit: a superset (keywords other than those named in the module
    docstring are taken to admit everything, and ``$ref`` is not followed)."""
    if schema is True:
        return ALL_KINDS
    if schema is False:
        return frozenset()
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return ALL_KINDS
    kinds = ALL_KINDS & _type_kinds(schema.get("type"))
    if "const" in schema:
        kinds &= {_kind_of(schema["const"])}
    enum = schema.get("enum")
    if isinstance(enum, list):
        kinds &= {_kind_of(v) for v in enum}
        if "const" in schema and not any(_same(schema["const"], v) for v in enum):
            return frozenset()
    for member in _members(schema, "allOf"):
        kinds &= value_kinds(member, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            kinds &= frozenset().union(*(value_kinds(m, depth + 1) for m in schema[key]))
    if schema.get("not") is True or schema.get("not") == {}:
        return frozenset()
    if "object" in kinds and _required_property_is_empty(schema, depth):
        kinds -= {"object"}
    if "array" in kinds and _required_item_is_empty(schema, depth):
        kinds -= {"array"}
    return kinds


def schema_violation(schema_json: str, text: str) -> str | None:
    """What is wrong with ``text`` as a value of the schema ``schema_json``, or ``None`` if it conforms (or if
    the ``jsonschema`` package is not installed: then only xgrammar's grammar stands behind the output)."""
    validator = _validator(schema_json)
    if validator is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"the output is not JSON ({exc})"
    from jsonschema.exceptions import best_match

    error = best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{error.message}" + (f" (at /{where})" if where else "")


@functools.lru_cache(maxsize=64)
def _validator(schema_json: str) -> Any:
    try:
        import jsonschema
    except ImportError:  # an optional dependency: without it the grammar alone constrains the output
        return None
    schema = json.loads(schema_json)
    return jsonschema.validators.validator_for(schema)(schema)


def _type_kinds(value: Any) -> frozenset[str]:
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if names is None:
        return ALL_KINDS
    kinds: set[str] = set()
    for name in names:
        kinds |= _TYPE_KINDS.get(name, ALL_KINDS) if isinstance(name, str) else ALL_KINDS
    return frozenset(kinds)


def _members(schema: dict[str, Any], key: str) -> list[Any]:
    value = schema.get(key)
    return value if isinstance(value, list) else []


def _required_property_is_empty(schema: dict[str, Any], depth: int) -> bool:
    properties, required = schema.get("properties"), schema.get("required")
    if not isinstance(properties, dict) or not isinstance(required, list):
        return False
    return any(name in properties and not value_kinds(properties[name], depth + 1)
               for name in required if isinstance(name, str))


def _required_item_is_empty(schema: dict[str, Any], depth: int) -> bool:
    min_items = schema.get("minItems", 0)
    if not isinstance(min_items, int) or min_items < 1:
        return False
    prefix = _members(schema, "prefixItems")
    if prefix:
        return any(not value_kinds(item, depth + 1) for item in prefix[:min_items]) or (
            len(prefix) < min_items and "items" in schema and not value_kinds(schema["items"], depth + 1))
    return "items" in schema and not value_kinds(schema["items"], depth + 1)


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "fraction"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _same(a: Any, b: Any) -> bool:
    """JSON equality: ``1 == 1.0`` but ``1 != true``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b
