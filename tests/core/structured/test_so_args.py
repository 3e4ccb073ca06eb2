"""``so_args`` validation: exactly one grammar key, the right value type, errors that say what is allowed."""

from __future__ import annotations

import json

import pytest

from deepinfer.structured import SO_ARGS_KINDS, GrammarSpec, parse_so_args

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}


def test_each_kind_parses():
    assert parse_so_args({"regex": r"\d+"}) == GrammarSpec("regex", r"\d+")
    assert parse_so_args({"ebnf": 'root ::= "x"'}) == GrammarSpec("ebnf", 'root ::= "x"')
    spec = parse_so_args({"json_schema": SCHEMA})
    assert spec.kind == "json_schema" and json.loads(spec.source) == SCHEMA
    assert set(SO_ARGS_KINDS) == {"regex", "json_schema", "ebnf"}


def test_schema_as_dict_or_string_is_one_cache_key_and_keeps_property_order():
    as_dict = parse_so_args({"json_schema": SCHEMA})
    as_text = parse_so_args({"json_schema": json.dumps(SCHEMA, indent=4)})
    assert as_dict == as_text and hash(as_dict) == hash(as_text)
    # Property order decides output order, so it must survive canonicalisation.
    assert list(json.loads(as_dict.source)["properties"]) == ["b", "a"]


def test_spec_passes_through():
    spec = GrammarSpec("regex", "a|b")
    assert parse_so_args(spec) is spec


@pytest.mark.parametrize(
    "so_args, message",
    [
        ("[0-9]+", r"so_args must be a dict with exactly one of 'regex' .*'json_schema' .*'ebnf'.*got str"),
        ({}, r"exactly one of .*got none"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, r"exactly one of .*got \['ebnf', 'regex'\]"),
        ({"grammar": "x"}, r"unknown key\(s\) \['grammar'\].*exactly one of 'regex'"),
        ({"regex": 5}, r"so_args\['regex'\] must be a non-empty string, got int 5"),
        ({"ebnf": "  "}, r"so_args\['ebnf'\] must be a non-empty string"),
        ({"json_schema": "{not json"}, r"so_args\['json_schema'\] is a string but not valid JSON"),
        ({"json_schema": [1, 2]}, r"so_args\['json_schema'\] must be a JSON schema object .*got list"),
        ({"json_schema": '"just a string"'}, r"so_args\['json_schema'\] must be a JSON schema object"),
        ({"json_schema": {"x": object()}}, r"so_args\['json_schema'\] is not JSON-serialisable"),
    ],
)
def test_invalid_forms_name_the_key_and_what_is_allowed(so_args, message):
    with pytest.raises(ValueError, match=message):
        parse_so_args(so_args)
