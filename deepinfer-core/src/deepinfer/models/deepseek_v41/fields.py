"""Typed reads of config.json fields, each error naming the field and the allowed range.

Self-contained on purpose: a shared field-validation helper may replace it; the config module uses only
:class:`Fields`' methods.  Errors are V4's :class:`ConfigError` (a ``ValueError``), so both models' config
errors are caught alike.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from deepinfer.models.deepseek_v4.config import ConfigError

__all__ = ["ConfigError", "Fields"]

_MISSING = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Fields:
    """The fields of one config dict; ``prefix`` (e.g. ``"text_config."``) goes before every name in errors.

    A key present with the value ``null`` reads as its default, as transformers' dataclass fields do.
    """

    __slots__ = ("_raw", "_prefix")

    def __init__(self, raw: dict[str, Any], prefix: str = ""):
        self._raw, self._prefix = raw, prefix

    def get(self, name: str, default: Any = None) -> Any:
        value = self._raw.get(name, _MISSING)
        return default if value is _MISSING or value is None else value

    def has(self, name: str) -> bool:
        return self._raw.get(name) is not None

    def error(self, name: str, wanted: str, value: Any) -> ConfigError:
        return ConfigError(f"{self._prefix}{name} must be {wanted}, got {value!r}")

    def integer(self, name: str, default: int, low: int | None = None, high: int | None = None) -> int:
        """An integer in ``[low, high]`` (either bound optional)."""
        value = self.get(name, default)
        if not _is_int(value) or (low is not None and value < low) or (high is not None and value > high):
            bounds = f"in [{low}, {high}]" if low is not None and high is not None else (
                f">= {low}" if low is not None else f"<= {high}" if high is not None else "")
            raise self.error(name, f"an integer {bounds}".rstrip(), value)
        return value

    def optional_integer(self, name: str) -> int | None:
        value = self.get(name)
        if value is not None and not _is_int(value):
            raise self.error(name, "an integer or null", value)
        return value

    def number(self, name: str, default: float, low: float | None = None, positive: bool = False) -> float:
        """A number (int or float), ``> 0`` if ``positive``, ``>= low`` if given."""
        value = self.get(name, default)
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and (not positive or value > 0) and (low is None or value >= low))
        if not ok:
            raise self.error(name, "a number > 0" if positive else f"a number >= {low}" if low is not None
                             else "a number", value)
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise self.error(name, "true or false", value)
        return value

    def choice(self, name: str, default: str, choices: Collection[str]) -> str:
        value = self.get(name, default)
        if value not in choices:
            raise self.error(name, f"one of {sorted(choices)}", value)
        return value

    def integers(self, name: str, default: list[int] | None = None, low: int | None = None) -> list[int] | None:
        """A list of integers (each ``>= low`` if given), or ``default`` when absent."""
        value = self.get(name, default)
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or not all(_is_int(v) and (low is None or v >= low) for v in value):
            raise self.error(name, "a list of integers" + (f" >= {low}" if low is not None else ""), value)
        return list(value)

    def mapping(self, name: str) -> dict[str, Any] | None:
        value = self.get(name)
        if value is not None and not isinstance(value, dict):
            raise self.error(name, "an object", value)
        return value
