"""Structured output: constrain generation by a regex, a JSON schema or an EBNF grammar.

    .venv/bin/python examples/_structured_output.py            # the embedded tiny model, offline
    DEEPINFER_HF_MODEL_DIR=/path/to/checkpoint .venv/bin/python examples/_structured_output.py

Each request names one grammar in ``SamplingParams(so_args=...)``; constrained and free requests run
in one batch.  A request with an invalid grammar fails alone (its output carries xgrammar's message)
while the others complete.
"""

from __future__ import annotations

import json
import re

from deepinfer import LLM, SamplingParams

PHONE = r"\(\d{3}\) \d{3}-\d{4}"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "age": {"type": "integer", "minimum": 1, "maximum": 12},
        "pet": {"enum": ["dog", "cat", "bunny", "bird"]},
    },
    "required": ["name", "age", "pet"],
}

# GBNF-style EBNF; the root rule is `root`.
SENTENCE = r"""
root    ::= subject " " verb " " object "."
subject ::= "Lily" | "Tom" | "The little dog"
verb    ::= "saw" | "found" | "liked"
object  ::= "a " thing | "the " thing
thing   ::= "ball" | "kite" | "red hat" | "big tree"
"""


def main() -> None:
    llm = LLM()  # DEEPINFER_HF_MODEL_DIR, else the cached default, else the embedded tiny model
    requests = [
        ("Lily's phone number is ", SamplingParams(temperature=0, max_tokens=32, so_args={"regex": PHONE})),
        ("Here is a child as JSON: ", SamplingParams(temperature=1.0, seed=7, max_tokens=96,
                                                     so_args={"json_schema": PERSON})),
        ("Once upon a time, ", SamplingParams(temperature=1.0, seed=1, max_tokens=48, so_args={"ebnf": SENTENCE})),
        ("Once upon a time, ", SamplingParams(temperature=0.8, seed=2, max_tokens=24)),  # free, same batch
        ("Broken grammar: ", SamplingParams(max_tokens=8, so_args={"regex": "(unclosed"})),  # fails alone
    ]
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests])

    for (prompt, params), out in zip(requests, outputs, strict=True):
        kind = next(iter(params.so_args), "free") if params.so_args else "free"
        if out.error:
            print(f"[{kind}] {prompt!r} -> error: {out.error}")
            continue
        text = out.outputs[0].text
        print(f"[{kind}] {prompt!r} -> {text!r}")
        if kind == "regex":
            assert re.fullmatch(PHONE, text), text
        elif kind == "json_schema":
            value = json.loads(text)
            assert set(PERSON["required"]) <= set(value), value
        elif kind == "ebnf":
            assert text.endswith("."), text


if __name__ == "__main__":
    main()
