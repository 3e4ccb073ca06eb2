"""Typed reads of a config's fields: each error names the file and the field, what it takes and what was found.

A model's config parser reads every field through :class:`Fields` instead of ``int(raw.get(...))``, so a
string, a null, a fraction, a boolean or an out-of-range value fails at load with one line such as::

    /ckpt/config.json: num_hidden_layers must be an integer >= 1, found -2

A field that is absent takes its default (transformers' default, which is what that model's oracle uses); a
field that is present must be valid, whatever its default.  Only ``optional_*`` reads take JSON ``null`` as
"not set"; elsewhere null is an error.  Constraints between fields are the parser's: :meth:`Fields.error`
builds their message in the same form.

    fields = Fields.of(raw, "/ckpt/config.json")
    layers = fields.integer("num_hidden_layers", 43, lo=1)
    limit = fields.optional_number("swiglu_limit", lo=0, lo_open=True)
    top_k = fields.integer("num_experts_per_tok", 6, lo=1, hi=experts)
    eos = fields.optional_ids("eos_token_id", 1, hi=vocab - 1)  # an id, a list of ids, or null
    rope = fields.section("rope_scaling")                  # a nested object, or None
    ratios = fields.optional_integers("compress_ratios", lengths=(n, n + 1), lo=0)  # None if absent
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer.models.checkpoint_files import CheckpointError


class ConfigError(CheckpointError):
    """A config file cannot describe a model we can build; the message names the file and the field."""


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: Default meaning "the field must be present".
REQUIRED: Any = _Required()


def show(value: Any, limit: int = 80) -> str:
    """``value`` as it reads in JSON (``null``, ``true``, ``"4"``), cut to ``limit`` characters."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bound(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {show(lo)}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {show(hi)}")
    return " and ".join(parts)


def _in_range(x: float, lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> bool:
    if lo is not None and (x <= lo if lo_open else x < lo):
        return False
    return not (hi is not None and (x >= hi if hi_open else x > hi))


def _as_int(value: Any) -> int | None:
    """``value`` as an int if it is one (an integral float such as ``4.0`` counts; booleans do not)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


@dataclass(slots=True, frozen=True)
class Fields:
    """The fields of one JSON object (a config file, or a section of one), read with names in every error.

    ``source`` names the file in messages; ``prefix`` is the section's path (``"rope_parameters.main."``).
    """

    raw: Mapping[str, Any]
    source: str = "config"
    prefix: str = ""

    @classmethod
    def of(cls, raw: Any, source: str = "config", prefix: str = "") -> Fields:
        if not isinstance(raw, Mapping):
            where = f"{prefix.rstrip('.')} " if prefix else ""
            raise ConfigError(f"{source}: {where}must be a JSON object, found {show(raw)}")
        return cls(raw, source, prefix)

    def error(self, name: str, expected: str, found: Any = REQUIRED) -> ConfigError:
        """A one-line error: ``<source>: <prefix><name> must be <expected>, found <value>`` (the stored value
        unless ``found`` is given)."""
        value = self.raw.get(name) if found is REQUIRED else found
        return ConfigError(f"{self.source}: {self.prefix}{name} must be {expected}, found {show(value)}")

    def has(self, name: str) -> bool:
        """The field is present and not null."""
        return self.raw.get(name) is not None

    def _get(self, name: str, default: Any, expected: str, optional: bool) -> tuple[bool, Any]:
        """(present, value); absent (or null when ``optional``) gives ``(False, default)``."""
        if name not in self.raw or (optional and self.raw[name] is None):
            if default is REQUIRED:
                raise ConfigError(f"{self.source}: {self.prefix}{name} is missing; it must be {expected}")
            return False, default
        return True, self.raw[name]

    def integer(self, name: str, default: Any = REQUIRED, *, lo: int | None = None, hi: int | None = None) -> int:
        """An integer in ``[lo, hi]``."""
        return self._integer(name, default, lo, hi, optional=False)

    def optional_integer(self, name: str, default: int | None = None, *, lo: int | None = None,
                         hi: int | None = None) -> int | None:
        """An integer in ``[lo, hi]``, or ``default`` when absent or null."""
        return self._integer(name, default, lo, hi, optional=True)

    def _integer(self, name: str, default: Any, lo: int | None, hi: int | None, optional: bool) -> Any:
        expected = " ".join(filter(None, ["an integer", _bound(lo, hi)]))
        present, value = self._get(name, default, expected, optional)
        if not present:
            return value
        number = _as_int(value)
        if number is None or not _in_range(number, lo, hi):
            raise self.error(name, expected)
        return number

    def number(self, name: str, default: Any = REQUIRED, *, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False, hi_open: bool = False) -> float:
        """A finite number in the range (``lo_open`` / ``hi_open`` exclude the bound)."""
        return self._number(name, default, lo, hi, lo_open, hi_open, optional=False)

    def optional_number(self, name: str, default: float | None = None, *, lo: float | None = None,
                        hi: float | None = None, lo_open: bool = False, hi_open: bool = False) -> float | None:
        """A finite number in the range, or ``default`` when absent or null."""
        return self._number(name, default, lo, hi, lo_open, hi_open, optional=True)

    def _number(self, name: str, default: Any, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool,
                optional: bool) -> Any:
        expected = " ".join(filter(None, ["a finite number", _bound(lo, hi, lo_open, hi_open)]))
        present, value = self._get(name, default, expected, optional)
        if not present:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(name, expected)
        if not _in_range(value, lo, hi, lo_open, hi_open):
            raise self.error(name, expected)
        return float(value)

    def boolean(self, name: str, default: Any = REQUIRED) -> bool:
        present, value = self._get(name, default, "true or false", optional=False)
        if present and not isinstance(value, bool):
            raise self.error(name, "true or false")
        return value

    def string(self, name: str, default: Any = REQUIRED, *, choices: Collection[str] | None = None) -> str:
        """A string, one of ``choices`` if given."""
        return self._string(name, default, choices, optional=False)

    def optional_string(self, name: str, default: str | None = None, *,
                        choices: Collection[str] | None = None) -> str | None:
        return self._string(name, default, choices, optional=True)

    def _string(self, name: str, default: Any, choices: Collection[str] | None, optional: bool) -> Any:
        expected = f"one of {sorted(choices)}" if choices is not None else "a string"
        present, value = self._get(name, default, expected, optional)
        if present and (not isinstance(value, str) or (choices is not None and value not in choices)):
            raise self.error(name, expected)
        return value

    def integers(self, name: str, default: Any = REQUIRED, *, lengths: Collection[int] | None = None,
                 lo: int | None = None, hi: int | None = None) -> tuple[int, ...]:
        """A list of integers in ``[lo, hi]`` whose length is one of ``lengths`` (any length if None)."""
        return self._integers(name, default, lengths, lo, hi, optional=False)

    def optional_integers(self, name: str, default: tuple[int, ...] | None = None, *,
                          lengths: Collection[int] | None = None, lo: int | None = None,
                          hi: int | None = None) -> tuple[int, ...] | None:
        return self._integers(name, default, lengths, lo, hi, optional=True)

    def _integers(self, name: str, default: Any, lengths: Collection[int] | None, lo: int | None, hi: int | None,
                  optional: bool) -> Any:
        bound = _bound(lo, hi)
        expected = f"{_lengths(lengths)}of integers{' ' + bound if bound else ''}"
        present, value = self._get(name, default, expected, optional)
        if not present:
            return value
        if not isinstance(value, list) or (lengths is not None and len(value) not in lengths):
            raise self.error(name, expected)
        for i, item in enumerate(value):
            number = _as_int(item)
            if number is None or not _in_range(number, lo, hi):
                raise self.error(f"{name}[{i}]", " ".join(filter(None, ["an integer", bound])), item)
        return tuple(int(v) for v in value)

    def optional_ids(self, name: str, default: int | list[int] | None = None, *, lo: int | None = 0,
                     hi: int | None = None) -> int | list[int] | None:
        """One integer or a list of them (token ids such as ``eos_token_id``), or ``default`` when absent; an
        explicit null reads as None."""
        if name not in self.raw:
            return default
        if isinstance(self.raw[name], list):
            return list(self.integers(name, lo=lo, hi=hi))
        return self.optional_integer(name, lo=lo, hi=hi)

    def strings(self, name: str, default: Any = REQUIRED, *, lengths: Collection[int] | None = None,
                choices: Collection[str] | None = None) -> tuple[str, ...]:
        """A list of strings, each one of ``choices`` if given, whose length is one of ``lengths``."""
        return self._strings(name, default, lengths, choices, optional=False)

    def optional_strings(self, name: str, default: tuple[str, ...] | None = None, *,
                         lengths: Collection[int] | None = None,
                         choices: Collection[str] | None = None) -> tuple[str, ...] | None:
        return self._strings(name, default, lengths, choices, optional=True)

    def _strings(self, name: str, default: Any, lengths: Collection[int] | None, choices: Collection[str] | None,
                 optional: bool) -> Any:
        item_expected = f"one of {sorted(choices)}" if choices is not None else "a string"
        expected = f"{_lengths(lengths)}of strings" + (f" from {sorted(choices)}" if choices is not None else "")
        present, value = self._get(name, default, expected, optional)
        if not present:
            return value
        if not isinstance(value, list) or (lengths is not None and len(value) not in lengths):
            raise self.error(name, expected)
        for i, item in enumerate(value):
            if not isinstance(item, str) or (choices is not None and item not in choices):
                raise self.error(f"{name}[{i}]", item_expected, item)
        return tuple(value)

    def section(self, name: str) -> Fields | None:
        """A nested object as :class:`Fields` (its errors name ``name.field``); None when absent or null."""
        value = self.raw.get(name)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise self.error(name, "a JSON object")
        return Fields(value, self.source, f"{self.prefix}{name}.")


def _lengths(lengths: Collection[int] | None) -> str:
    if lengths is None:
        return "a list "
    options = sorted(set(lengths))
    return f"a list of {' or '.join(map(str, options))} entries "
