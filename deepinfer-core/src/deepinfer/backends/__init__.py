"""Backends: discovered through pluggy entry points; see :mod:`deepinfer.backends.hookspecs`."""

from deepinfer.backends.backend import Backend
from deepinfer.backends.hookspecs import hookimpl
from deepinfer.backends.registry import BackendError, current_backend, discover, select_backend

__all__ = ["Backend", "BackendError", "current_backend", "discover", "hookimpl", "select_backend"]
