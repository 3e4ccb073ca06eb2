"""``tool_choice`` ``"required"`` or a named function, enforced: an EBNF grammar (``so_args={"ebnf": ...}``) whose
only sentences are a DSML tool-call block, so the structured-output machinery makes the model call a tool.

The reply is the block alone (after the reasoning and ``</think>`` when the prompt opened the reasoning; the
reasoning may not contain ``</``).  Each invoke names one of the allowed functions; its parameters are the
function's declared properties in their declared order (the ``required`` ones always), strings written as is
(without ``<``), enums as their values, other types as that JSON type; a function that declares no properties
takes any parameters.  With
``parallel_tool_calls`` false the block holds exactly one call.
"""

from __future__ import annotations

import json
from typing import Any

from deepinfer.chat.dsml import (
    BLOCK_SEPARATOR,
    CALLS_CLOSE,
    CALLS_OPEN,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
)
from deepinfer.chat.reasoning import END_THINK

_JSON = r"""
json_value ::= json_object | json_array | json_string | json_number | "true" | "false" | "null"
json_object ::= "{" ws (json_string ws ":" ws json_value ws ("," ws json_string ws ":" ws json_value ws)*)? "}"
json_array ::= "[" ws (json_value ws ("," ws json_value ws)*)? "]"
json_string ::= "\"" ([^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]))* "\""
json_number ::= json_integer ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
json_integer ::= "-"? ("0" | [1-9] [0-9]*)
ws ::= [ \t\n]*
text_value ::= [^<]*
reasoning ::= ([^<] | "<" [^/])*
any_param ::= "PARAM_OPEN name=\"" [a-zA-Z0-9_.:-]+ "\" string=\"" any_value "PARAM_CLOSE"
any_value ::= "true\">" text_value | "false\">" json_value
""".replace("PARAM_OPEN", PARAM_OPEN).replace("PARAM_CLOSE", PARAM_CLOSE)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


#: JSON rules for a schema ``type`` (strings are written as is, so they are not here).
_JSON_TYPES = {"boolean": '("true" | "false")', "integer": 'json_integer', "number": "json_number",
               "null": '"null"', "object": "json_object", "array": "json_array"}


def _param(name: str, schema: Any) -> str:
    """One parameter: a string property as text, an enum as its values, a typed one as that JSON type, an
    untyped one as text or any JSON."""
    schema = schema if isinstance(schema, dict) else {}
    kind, enum = schema.get("type"), schema.get("enum")
    head = _literal(f'{PARAM_OPEN} name="{name}" string="')
    tail = _literal(PARAM_CLOSE)
    if isinstance(enum, list) and enum:
        strings = [v for v in enum if isinstance(v, str)]
        others = [json.dumps(v) for v in enum if not isinstance(v, str)]
        options = [f'"true\\">" ({" | ".join(map(_literal, strings))})'] if strings else []
        options += [f'"false\\">" ({" | ".join(map(_literal, others))})'] if others else []
        return f'{head} ({" | ".join(options)}) {tail}'
    if kind == "string":
        return f'{head} "true\\">" text_value {tail}'
    if isinstance(kind, str) and kind in _JSON_TYPES:
        return f'{head} "false\\">" {_JSON_TYPES[kind]} {tail}'
    return f'{head} any_value {tail}'


def _parameters(function: dict[str, Any]) -> str:
    """The parameter lines of one function (each followed by a newline)."""
    schema = function.get("parameters") or {}
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict) or not properties:
        return '("\\n" | (any_param "\\n")+)'
    required = set(schema.get("required") or ())
    items = [f'({_param(name, sub)} "\\n")' + ("" if name in required else "?") for name, sub in properties.items()]
    return f'({" ".join(items)})' if required else f'("\\n" | {" ".join(items)})'  # none: ">\\n\\n</..."


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None = None, reasoning_first: bool = False,
                      parallel: bool = True) -> str:
    """The EBNF for a block that calls ``name`` (or any of ``tools`` when None).  Raises ``ValueError`` when
    ``name`` is not among ``tools``."""
    functions = [t["function"] for t in tools]
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    rules = []
    for k, function in enumerate(functions):
        head = _literal(f'{INVOKE_OPEN} name="{function["name"]}">\n')
        rules.append(f"invoke_{k} ::= {head} {_parameters(function)} {_literal(INVOKE_CLOSE)}")
    invoke = " | ".join(f"invoke_{k}" for k in range(len(functions)))
    more = ' ("\\n" invoke)*' if parallel else ""
    block = f'{_literal(BLOCK_SEPARATOR + CALLS_OPEN + chr(10))} invoke{more} {_literal(chr(10) + CALLS_CLOSE)}'
    root = f'reasoning {_literal(END_THINK)} {block}' if reasoning_first else block
    return "\n".join([f"root ::= {root}", f"invoke ::= {invoke}", *rules]) + _JSON
