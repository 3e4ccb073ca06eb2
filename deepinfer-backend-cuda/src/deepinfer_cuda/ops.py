"""Kernels that override core's reference ops, by op name.  Imported only once the backend is chosen."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

OVERRIDES: dict[str, Callable[..., Any]] = {}
