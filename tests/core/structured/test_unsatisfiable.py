"""Grammars no output can satisfy fail their own request with a clear error, never with bad output.

- a grammar with no first token (a regex that matches nothing; a string this vocabulary cannot spell) is
  rejected when the request is added;
- a grammar that reaches a dead end after some tokens fails the request then (it used to end in "internal
  error: the grammar rejected sampled token 0");
- a JSON schema that admits no value is rejected, and output that xgrammar let through but that fails the
  schema (a keyword it does not enforce) is never returned as a result.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.structured import GrammarCompiler
from tests.support.toy_model import ToyCausalLM, toy_tokenizer


@pytest.fixture(scope="module")
def llm():
    tokenizer = toy_tokenizer()
    return LLM.from_model(ToyCausalLM(len(tokenizer), seed=6), tokenizer)


def _run(llm, so_args, temperature=0.0, max_tokens=12):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    bad = SamplingParams(temperature=temperature, seed=1, max_tokens=max_tokens, so_args=so_args, n=2)
    outs = llm.generate(["Once upon", "The quick", "Le café"], [good, bad, good], use_tqdm=False)
    assert all(o.error is None and len(o.outputs[0].token_ids) == 4 for o in (outs[0], outs[2]))
    assert not llm.engine.has_unfinished() and not llm.engine.seqs
    return outs[1]


@pytest.mark.parametrize("so_args", [{"regex": r"[^\s\S]"}, {"regex": r"[^\s\S]+x"},
                                     {"ebnf": 'root ::= [^\\x00-\\U0010FFFF]'}], ids=["empty-class", "empty-prefix",
                                                                                   "ebnf-empty-class"])
def test_grammar_with_no_first_token_is_rejected(llm, so_args):
    out = _run(llm, so_args)
    assert out.outputs == [] and out.finished
    assert "admits no output" in out.error and "internal error" not in out.error


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_that_dead_ends_fails_its_request(llm, temperature):
    out = _run(llm, {"regex": r"ab[^\s\S]"}, temperature)
    assert out.outputs == [] and out.finished
    assert "no token can continue it after" in out.error and "('ab')" in out.error
    assert "internal error" not in out.error


def test_string_the_vocabulary_cannot_spell_is_rejected():
    """A byte-level BPE trained without the full byte alphabet cannot spell "é"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["plain ascii text only"] * 4, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<bos>", "<eos>"], show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>")
    llm = LLM.from_model(ToyCausalLM(len(tokenizer), seed=1), tokenizer)
    spellable, unspellable = llm.generate([[5, 6], [5, 6]], [
        SamplingParams(temperature=0, max_tokens=6, so_args={"regex": "(ascii|text)"}),
        SamplingParams(temperature=0, max_tokens=6, so_args={"regex": "(é|ü)+"}),
    ], use_tqdm=False)
    assert spellable.error is None and spellable.outputs[0].text in ("ascii", "text")
    assert unspellable.outputs == [] and "admits no output" in unspellable.error


EMPTY_SCHEMAS = {
    "not anything": {"not": {}},
    "not true": {"type": "integer", "not": True},
    "no type": {"type": []},
    "allOf disjoint types": {"allOf": [{"type": "string"}, {"type": "integer"}]},
    "const outside enum": {"const": 1, "enum": [2, 3]},
    "const of another type": {"type": "string", "const": 5},
    "enum of another type": {"type": "integer", "enum": ["a", "b"]},
    "anyOf of nothing": {"anyOf": [{"not": {}}, {"type": []}]},
    "nested property": {"type": "object", "properties": {"a": {"allOf": [{"type": "null"}, {"type": "array"}]}},
                        "required": ["a"]},
    "minLength above maxLength": {"type": "string", "minLength": 5, "maxLength": 2},
}


@pytest.mark.parametrize("name", sorted(EMPTY_SCHEMAS))
def test_schema_that_admits_nothing_is_rejected(llm, name):
    out = _run(llm, {"json_schema": EMPTY_SCHEMAS[name]})
    assert out.outputs == [] and out.error is not None and "so_args['json_schema']" in out.error


def test_false_schema_is_refused_when_the_params_are_made():
    with pytest.raises(ValueError, match="admits no value"):
        SamplingParams(so_args={"json_schema": False})
    assert SamplingParams(so_args={"json_schema": True}).so_args == {"json_schema": True}  # any value


def test_schema_with_a_satisfiable_not_is_not_rejected():
    compiler = GrammarCompiler(toy_tokenizer(), 400)
    compiler.compile({"json_schema": {"type": "integer", "not": {"const": 3}}})  # admits 4: no error
    compiler.compile({"json_schema": {"anyOf": [{"not": {}}, {"type": "string"}]}})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_output_that_fails_the_schema_is_never_returned(llm, temperature):
    """xgrammar does not enforce ``not`` with a value: it lets "1" or "2" through, which fail this schema."""
    schema = {"enum": [1, 2], "not": {"enum": [1, 2]}}
    out = _run(llm, {"json_schema": schema}, temperature)
    assert out.outputs == [] and "does not satisfy so_args['json_schema']" in out.error


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_valid_schema_output_is_still_returned(llm, temperature):
    schema = {"type": "object", "properties": {"x": {"enum": [1, 2, 3]}}, "required": ["x"],
              "not": {"properties": {"x": {"const": 9}}}}
    out = _run(llm, {"json_schema": schema}, temperature, max_tokens=20)
    assert out.error is None
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), schema)
