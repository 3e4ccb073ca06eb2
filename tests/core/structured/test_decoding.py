"""Constrained decoding without the engine: random logits, masked by the grammar, always yield valid output.

Each case runs a batch of 3 requests for a few seeds, greedy (argmax) and sampled (temperature 1),
until every matcher terminates, then checks the text with a checker independent of xgrammar where
one exists (``re.fullmatch``, ``json`` + ``jsonschema``, a Python parse) and with a fresh xgrammar
matcher for the EBNF grammars.
"""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest
import xgrammar as xgr

from deepinfer.structured import GrammarCompiler, allocate_token_bitmask, fill_token_bitmask, grammar_compiler
from tests.support.structured import build_tokenizer, decode_random

SEEDS = (0, 1, 2)
PAD_VOCAB = 37  # the model's vocab exceeds the tokenizer's, as real checkpoints pad it

REGEXES = [
    r"(\+1 )?\(\d{3}\) \d{3}-\d{4}",
    r"[a-z]{1,8}@[a-z]{2,6}\.(com|org|net)",
    r"(yes|no|maybe)",
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "member": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

TUPLE_EBNF = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [0-9]{1,3} | [a-z]{1,5}\n'
TUPLE_REGEX = r"\((?:[0-9]{1,3}|[a-z]{1,5})(?:,(?:[0-9]{1,3}|[a-z]{1,5})){0,3}\)"
ARITH_EBNF = (
    'root ::= expr\n'
    'expr ::= term (("+" | "-") term){0,2}\n'
    'term ::= num | "(" expr ")"\n'
    'num ::= [1-9] [0-9]{0,2}\n'
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return grammar_compiler(tokenizer, len(tokenizer) + PAD_VOCAB)


def _generate(compiler, tokenizer, so_args, temperature, seed, batch=3):
    matchers = [compiler.matcher(so_args) for _ in range(batch)]
    outputs, done = decode_random(
        matchers, compiler.vocab_size, temperature=temperature, seed=seed, eos_id=tokenizer.eos_token_id
    )
    assert all(done), "every constrained request must reach a stop token"
    return [tokenizer.decode(ids) for ids in outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fullmatch(compiler, tokenizer, pattern, temperature):
    texts = [t for seed in SEEDS for t in _generate(compiler, tokenizer, {"regex": pattern}, temperature, seed)]
    for text in texts:
        assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"
    if pattern != r"(yes|no|maybe)":
        assert len(set(texts)) > len(texts) // 2, "different seeds should give different outputs"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("as_string", [False, True])
def test_json_schema_outputs_validate(compiler, tokenizer, temperature, as_string):
    so_args = {"json_schema": json.dumps(SCHEMA) if as_string else SCHEMA}
    for seed in SEEDS:
        for text in _generate(compiler, tokenizer, so_args, temperature, seed):
            value = json.loads(text)  # strict: no raw control characters
            jsonschema.validate(value, SCHEMA)
            assert list(value)[:2] == ["name", "age"], "properties come in schema order"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ebnf_tuple_outputs_match_grammar_and_equivalent_regex(compiler, tokenizer, temperature):
    checker = compiler.compile({"ebnf": TUPLE_EBNF})
    for seed in SEEDS:
        for text in _generate(compiler, tokenizer, {"ebnf": TUPLE_EBNF}, temperature, seed):
            assert re.fullmatch(TUPLE_REGEX, text), text
            fresh = xgr.GrammarMatcher(checker)
            assert fresh.accept_string(text) and fresh.is_completed(), text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_recursive_ebnf_outputs_are_arithmetic_expressions(compiler, tokenizer, temperature):
    checker = compiler.compile({"ebnf": ARITH_EBNF})
    for seed in SEEDS:
        for text in _generate(compiler, tokenizer, {"ebnf": ARITH_EBNF}, temperature, seed):
            tree = ast.parse(text, mode="eval")  # a Python expression ...
            allowed = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Constant)
            assert all(isinstance(n, allowed) for n in ast.walk(tree)), text  # ... of + - and integers only
            fresh = xgr.GrammarMatcher(checker)
            assert fresh.accept_string(text) and fresh.is_completed(), text


def test_constrained_and_free_requests_share_a_batch(compiler, tokenizer):
    pattern = REGEXES[0]
    matchers = [compiler.matcher({"regex": pattern}), None, compiler.matcher({"json_schema": SCHEMA}), None]
    outputs, done = decode_random(
        matchers, compiler.vocab_size, temperature=1.0, seed=3, eos_id=tokenizer.eos_token_id, max_steps=60
    )
    assert done[0] and done[2]
    assert re.fullmatch(pattern, tokenizer.decode(outputs[0]))
    jsonschema.validate(json.loads(tokenizer.decode(outputs[2])), SCHEMA)
    # Free rows were not constrained: they ran to the step limit over the whole vocabulary.
    assert len(outputs[1]) == len(outputs[3]) == 60 or done[1] or done[3]
    assert len(set(outputs[1] + outputs[3])) > 40


def test_free_rows_are_all_ones_and_padded_ids_are_never_allowed(compiler, tokenizer):
    vocab = compiler.vocab_size
    bitmask = allocate_token_bitmask(3, vocab)
    bitmask.zero_()
    matchers = [None, compiler.matcher({"json_schema": SCHEMA}), None]
    assert fill_token_bitmask(matchers, bitmask) is True
    assert bool((bitmask[[0, 2]] == -1).all())
    allowed = xgr.testing.bitmask_to_bool_mask(bitmask, vocab)
    assert not allowed[1, len(tokenizer) :].any(), "ids beyond the tokenizer are padding"
    assert allowed[1].sum() < len(tokenizer) // 4, "a JSON object must start with '{': few tokens allowed"
    assert fill_token_bitmask([None, None], bitmask) is False
