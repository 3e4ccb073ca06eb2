"""Structured output: constrain a request's tokens to a regex, a JSON schema or an EBNF grammar.

``SamplingParams(so_args=...)`` names the grammar; :func:`parse_so_args` validates it,
:func:`grammar_compiler` compiles it (cached per tokenizer), a :class:`GrammarMatcher` follows one
request through it, :func:`fill_token_bitmask` builds the step's CPU bitmask, and the
``apply_token_bitmask`` op masks the logits on the device.  :class:`GrammarMaskProvider` bundles
this for the engine (the sampler's ``TokenMaskProvider`` hook).  See ``docs/structured_output.md``.
"""

try:  # a dependency of deepinfer-core; an environment that lost it gets a message naming the package
    import xgrammar  # noqa: F401
except ModuleNotFoundError as exc:
    raise ModuleNotFoundError("structured output (SamplingParams(so_args=...)) needs the 'xgrammar' package, a "
                              "dependency of deepinfer-core that is missing here: pip install 'xgrammar>=0.1.25' "
                              f"(or reinstall deepinfer-core) [{exc}]", name="xgrammar") from exc

from deepinfer.structured.bitmask import allocate_token_bitmask, fill_draft_token_bitmask, fill_token_bitmask
from deepinfer.structured.compiler import GrammarCompiler, grammar_compiler, xgrammar_message
from deepinfer.structured.matcher import GrammarMatcher, bitmask_width, token_allowed
from deepinfer.structured.provider import GrammarMaskProvider
from deepinfer.structured.spec import SO_ARGS_KINDS, GrammarSpec, parse_so_args

__all__ = [
    "SO_ARGS_KINDS",
    "GrammarCompiler",
    "GrammarMaskProvider",
    "GrammarMatcher",
    "GrammarSpec",
    "allocate_token_bitmask",
    "bitmask_width",
    "fill_draft_token_bitmask",
    "fill_token_bitmask",
    "grammar_compiler",
    "parse_so_args",
    "token_allowed",
    "xgrammar_message",
]
