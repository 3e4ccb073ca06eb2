"""Grammar compilation: cached once per grammar and per tokenizer, thread-safe, clear errors for bad grammars."""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref

import pytest
import xgrammar as xgr

from deepinfer.structured import GrammarCompiler, grammar_compiler, xgrammar_message
from tests.support.structured import build_tokenizer

INVALID = [
    ("regex", "(ab"),
    ("regex", "[z-a]"),
    ("json_schema", '{"type": "nonsense"}'),
    ("ebnf", 'root ::= "a" undefined_rule'),
    ("ebnf", 'start ::= "a"'),  # no root rule
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _xgrammar_error(tokenizer, vocab_size, kind, source) -> str:
    """What xgrammar itself says about the grammar (compiled without deepinfer in the way)."""
    raw = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    compile_fn = {"regex": raw.compile_regex, "json_schema": raw.compile_json_schema, "ebnf": raw.compile_grammar}[kind]
    with pytest.raises(RuntimeError) as info:
        compile_fn(source)
    return xgrammar_message(info.value)


@pytest.mark.parametrize("kind, source", INVALID)
def test_invalid_grammar_raises_value_error_with_xgrammar_message(tokenizer, kind, source):
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    expected = _xgrammar_error(tokenizer, len(tokenizer), kind, source)
    assert expected and not expected.startswith("["), "the timestamp/location prefix is stripped"
    with pytest.raises(ValueError) as info:
        compiler.matcher({kind: source})
    message = str(info.value)
    assert message.startswith(f"so_args[{kind!r}]: invalid ") and expected in message
    # The failure is not cached, and it does not poison the compiler for other requests.
    assert not compiler.cached({kind: source})
    with pytest.raises(ValueError):
        compiler.compile({kind: source})
    assert compiler.matcher({"regex": "ok"}).accept(tokenizer.encode("ok", add_special_tokens=False)[0])


def test_same_grammar_compiles_once(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    first = compiler.compile({"json_schema": schema})
    assert compiler.compile({"json_schema": schema}) is first
    assert compiler.compile({"json_schema": '{"type": "object",  "properties": {"a": {"type": "integer"}}}'}) is first
    assert compiler.num_compiled == 1
    compiler.compile({"regex": "[0-9]+"})
    compiler.matcher({"regex": "[0-9]+"})
    assert compiler.num_compiled == 2


def test_concurrent_requests_for_one_grammar_compile_once(tokenizer, monkeypatch):
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    real = compiler._compile_now
    calls = []

    def slow_compile(spec):
        calls.append(spec)
        time.sleep(0.05)  # long enough that every thread arrives while the first compiles
        return real(spec)

    monkeypatch.setattr(compiler, "_compile_now", slow_compile)
    barrier = threading.Barrier(6)
    results = [None] * 6

    def worker(i):
        barrier.wait()
        results[i] = compiler.compile({"regex": "(a|b)+c"})

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and compiler.num_compiled == 1
    assert all(r is results[0] for r in results)


def test_lru_evicts_the_least_recently_used_grammar(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), max_cached=2)
    compiler.compile({"regex": "a"})
    compiler.compile({"regex": "b"})
    compiler.compile({"regex": "a"})  # refresh "a"
    compiler.compile({"regex": "c"})  # evicts "b"
    assert compiler.cached({"regex": "a"}) and compiler.cached({"regex": "c"}) and not compiler.cached({"regex": "b"})
    assert compiler.num_compiled == 3


def test_one_compiler_per_tokenizer_and_vocab_size(tokenizer):
    vocab = len(tokenizer)
    shared = grammar_compiler(tokenizer, vocab)
    assert grammar_compiler(tokenizer, vocab) is shared
    padded = grammar_compiler(tokenizer, vocab + 64)
    assert padded is not shared and padded.vocab_size == vocab + 64
    assert grammar_compiler(tokenizer, vocab, stop_token_ids=[0]).stop_token_ids == (0,)
    assert shared.stop_token_ids == (tokenizer.eos_token_id,)

    other = copy.deepcopy(tokenizer)  # equal but not the same object
    other_compiler = grammar_compiler(other, vocab)
    assert other_compiler is not shared
    released = weakref.ref(other_compiler)
    del other, other_compiler
    gc.collect()
    assert released() is None, "a tokenizer's compiler is dropped with the tokenizer"

    with pytest.raises(ValueError, match="vocab_size must be the model's vocabulary size"):
        GrammarCompiler(tokenizer, 0)
