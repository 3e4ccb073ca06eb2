"""Checks of one user-given value: each names the argument and what it takes, and returns the value normalised
(``numpy.int64(3)`` -> ``3``).  A value of the wrong type raises ``TypeError``; one out of range ``ValueError``."""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Callable
from typing import Any

#: ``check(name, value) -> normalised value``
Check = Callable[[str, Any], Any]


def _got(value: Any) -> str:
    return f"got {type(value).__name__} {value!r}"


def integer(low: int | None = None, high: int | None = None, *, optional: bool = False) -> Check:
    """An int (or anything with ``__index__``, not a bool) in ``[low, high]``; ``None`` too if ``optional``."""
    what = "an integer" + (f" in [{low}, {high}]" if low is not None and high is not None
                           else f" >= {low}" if low is not None else "")
    what = f"None or {what}" if optional else what

    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            hint = f" (int({value!r}) if you meant {int(value)})" if isinstance(value, float) and value.is_integer() \
                else ""
            raise TypeError(f"{name} must be {what}, {_got(value)}{hint}")
        value = operator.index(value)
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError(f"{name} must be {what}, got {value}")
        return value

    return check


def flag(*, optional: bool = False) -> Check:
    """``True`` or ``False`` (not 0/1, not a string: ``enforce_eager='no'`` would be truthy); ``None`` too if
    ``optional``."""

    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True{', False or None' if optional else ' or False'}, {_got(value)}")
        return value

    return check


def fraction() -> Check:
    """A finite real number in ``(0, 1]``."""

    def check(name: str, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number in (0, 1], {_got(value)}")
        if not (math.isfinite(value) and 0 < value <= 1):
            raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
        return float(value)

    return check


def path(*, optional: bool = False) -> Check:
    """A non-empty ``str`` or ``os.PathLike`` (kept as given); ``None`` too if ``optional``."""
    what = "a path or name (str or os.PathLike)" + (" or None" if optional else "")

    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"{name} must be {what}, {_got(value)}")
        if not os.fspath(value):
            raise ValueError(f"{name} must not be empty")
        return value

    return check


def text(*, optional: bool = False) -> Check:
    """A non-empty ``str``; ``None`` too if ``optional``."""
    what = "a string" + (" or None" if optional else "")

    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise TypeError(f"{name} must be {what}, {_got(value)}")
        if not value.strip():
            raise ValueError(f"{name} must not be empty")
        return value

    return check


def choice(*allowed: str) -> Check:
    """One of the strings ``allowed``."""

    def check(name: str, value: Any) -> Any:
        if not isinstance(value, str):
            raise TypeError(f"{name} must be one of {list(allowed)}, {_got(value)}")
        if value not in allowed:
            raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
        return value

    return check
