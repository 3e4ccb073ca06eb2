"""The plugin contract between deepinfer-core and backend distributions.

A backend distribution declares an entry point in the group ``deepinfer.backends`` whose value is a
module (or object) carrying ``@hookimpl`` functions.  The entry point's name is the backend's name.

Version 1 of the surface is one hook.  pluggy lets an implementation accept fewer arguments than the
spec names, so arguments added later are opt-in and old backends keep working.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from deepinfer.backends.backend import Backend

PROJECT_NAME = "deepinfer"
ENTRY_POINT_GROUP = "deepinfer.backends"
HOOK_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class BackendSpec:
    """Hook specifications; implementations are plain functions decorated with ``hookimpl``."""

    @hookspec
    def deepinfer_backend(self, api_version: int) -> Backend:
        """Return this plugin's :class:`~deepinfer.backends.backend.Backend`.

        Must be cheap and must not import device libraries (CUDA, torch_npu): heavy work belongs in
        ``Backend.unavailable_reason`` and ``Backend.load_ops``, which run only when the backend is chosen.
        """
        raise NotImplementedError  # a specification: each plugin's @hookimpl is what runs
