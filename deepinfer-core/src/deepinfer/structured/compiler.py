"""Grammar compilation through xgrammar, cached per tokenizer and per grammar.

Compiling a grammar against a vocabulary (precomputing which tokens each grammar state admits) costs
milliseconds to seconds, so it happens once per distinct grammar: a :class:`GrammarCompiler` belongs
to one (tokenizer, model vocab size) pair and keeps its compiled grammars in a bounded LRU.  Requests
that ask for the same grammar at the same time wait for one compilation instead of starting their
own.  An invalid grammar raises ``ValueError`` with xgrammar's message, so the engine can fail that
request alone.
"""

from __future__ import annotations

import json
import os
import re
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import xgrammar as xgr

from deepinfer.structured.matcher import GrammarMatcher
from deepinfer.structured.schema import empty_schema_reason
from deepinfer.structured.spec import GrammarSpec, parse_so_args

#: JSON output is compact (no free whitespace between tokens): a free-whitespace grammar lets a weak
#: or high-temperature model emit whitespace forever, which is valid JSON but never finishes.
JSON_ANY_WHITESPACE = False
#: No properties or items beyond those the schema names (xgrammar's strict mode).
JSON_STRICT = True

_KIND_LABEL = {"regex": "regular expression", "json_schema": "JSON schema", "ebnf": "EBNF grammar"}
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: ".
_LOG_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ", re.MULTILINE)


def xgrammar_message(error: BaseException) -> str:
    """xgrammar's error text without its timestamp and source-location prefix."""
    return _LOG_PREFIX.sub("", str(error)).strip()


class GrammarCompiler:
    """Compiles ``so_args`` grammars for one tokenizer and model vocabulary, each distinct grammar once.

    ``vocab_size`` is the model's (the width of its logits), which may exceed the tokenizer's: the
    extra ids are padding and are never allowed.  Thread-safe.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        stop_token_ids: list[int] | tuple[int, ...] | None = None,
        max_cached: int = 512,
    ) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be the model's vocabulary size (an int >= 1), got {vocab_size!r}")
        stops = list(stop_token_ids) if stop_token_ids else None
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stops
        )
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(self.tokenizer_info.stop_token_ids)
        self.max_cached = max_cached
        # Our LRU is the cache; xgrammar's own would hold a second copy of every grammar.
        self._xgr = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max(1, min(8, os.cpu_count() or 1)), cache_enabled=False
        )
        self._lock = threading.Lock()
        self._entries: OrderedDict[GrammarSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self.num_compiled = 0  # compilations actually run (cache misses), for tests and metrics

    def compile(self, so_args: dict[str, Any] | GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of ``so_args``, from the cache or compiled now.  Raises ``ValueError``."""
        spec = parse_so_args(so_args)
        with self._lock:
            found = self._entries.get(spec)
            if found is None:
                entry: Future[xgr.CompiledGrammar] = Future()
                self._entries[spec] = entry
                self.num_compiled += 1
                while len(self._entries) > self.max_cached:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(spec)
        if found is not None:
            return found.result()  # compiled, or being compiled by another thread
        try:
            compiled = self._compile_now(spec)
        except BaseException as e:
            with self._lock:  # an invalid grammar is not cached: the next request gets a fresh attempt
                if self._entries.get(spec) is entry:
                    del self._entries[spec]
            entry.set_exception(e)
            raise
        entry.set_result(compiled)
        return compiled

    def matcher(self, so_args: dict[str, Any] | GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for one request (compiles or reuses the grammar).  Raises ``ValueError``."""
        return GrammarMatcher(self.compile(so_args), self.vocab_size, spec=parse_so_args(so_args))

    def cached(self, so_args: dict[str, Any] | GrammarSpec) -> bool:
        """Whether ``so_args`` is compiled (or compiling) now."""
        with self._lock:
            return parse_so_args(so_args) in self._entries

    def _compile_now(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_schema":  # xgrammar would ignore what it does not support and compile something
            empty = empty_schema_reason(json.loads(spec.source))
            if empty is not None:
                raise ValueError(f"so_args['json_schema']: the schema admits no value: {empty}")
        try:
            if spec.kind == "regex":
                return self._xgr.compile_regex(spec.source)
            if spec.kind == "json_schema":
                return self._xgr.compile_json_schema(
                    spec.source, any_whitespace=JSON_ANY_WHITESPACE, strict_mode=JSON_STRICT
                )
            return self._xgr.compile_grammar(spec.source, root_rule_name="root")
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"so_args[{spec.kind!r}]: invalid {_KIND_LABEL[spec.kind]}: {xgrammar_message(e)}") from e


# --------------------------------------------------------------------------------------------------
# One compiler per (tokenizer object, model vocab size, stop tokens), shared by every engine using them.
# --------------------------------------------------------------------------------------------------

_compilers: dict[tuple[int, int, tuple[int, ...] | None], tuple[Any, GrammarCompiler]] = {}
_compilers_lock = threading.RLock()  # re-entrant: a finalizer may run during a GC inside the lock


def grammar_compiler(
    tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | tuple[int, ...] | None = None
) -> GrammarCompiler:
    """The shared :class:`GrammarCompiler` of ``tokenizer`` (by identity) at the model's ``vocab_size``.

    Built on first use (reading the vocabulary takes a moment for a large tokenizer) and dropped when
    the tokenizer is garbage-collected.
    """
    key = (id(tokenizer), vocab_size, tuple(stop_token_ids) if stop_token_ids else None)
    with _compilers_lock:
        found = _compilers.get(key)
        if found is not None and _deref(found[0]) is tokenizer:
            return found[1]
        compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids=stop_token_ids)
        _compilers[key] = (_weak_or_strong(tokenizer, key), compiler)
        return compiler


def _weak_or_strong(tokenizer: Any, key: tuple) -> Any:
    try:
        ref = weakref.ref(tokenizer)
    except TypeError:  # not weak-referenceable: keep it alive for the process
        return tokenizer
    weakref.finalize(tokenizer, _forget, key, ref)
    return ref


def _deref(held: Any) -> Any:
    return held() if isinstance(held, weakref.ref) else held


def _forget(key: tuple, ref: weakref.ref) -> None:
    with _compilers_lock:
        found = _compilers.get(key)
        if found is not None and found[0] is ref:
            del _compilers[key]
