"""Discover backends through entry points and pick the one ``DEEPINFER_ACCELERATOR`` names.

pluggy's ``load_setuptools_entrypoints`` silently skips a second plugin of an already-registered
name, which would hide two distributions claiming one backend name; so entry points are walked
here and each is registered under ``<distribution>:<name>`` to report such clashes.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from importlib import metadata

import pluggy

from deepinfer import envs
from deepinfer.backends.backend import Backend
from deepinfer.backends.hookspecs import ENTRY_POINT_GROUP, HOOK_API_VERSION, PROJECT_NAME, BackendSpec

logger = logging.getLogger(__name__)


class BackendError(RuntimeError):
    """No usable backend for the requested name; the message says what to do."""


@dataclass(slots=True, frozen=True)
class InstalledBackend:
    """One entry point of the ``deepinfer.backends`` group and what it yielded."""

    name: str
    distribution: str
    backend: Backend | None
    load_error: str | None

    def unusable_reason(self) -> str | None:
        if self.backend is None:
            return f"plugin failed to load: {self.load_error}"
        try:
            return self.backend.unavailable_reason()
        except Exception as exc:  # a broken check must not hide the other backends
            return f"availability check raised {type(exc).__name__}: {exc}"


def _dist_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "<unknown distribution>"


def discover() -> list[InstalledBackend]:
    """Load every ``deepinfer.backends`` entry point; never raises for one broken plugin."""
    found: list[InstalledBackend] = []
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = _dist_name(ep)
        try:
            # One manager per plugin: pluggy validates the hookimpl against the spec on register.
            pm = pluggy.PluginManager(PROJECT_NAME)
            pm.add_hookspecs(BackendSpec)
            pm.register(ep.load(), name=f"{dist}:{ep.name}")
            results = pm.hook.deepinfer_backend(api_version=HOOK_API_VERSION)
            backend = results[0] if results else None
            if backend is None:
                raise BackendError("its deepinfer_backend hook returned nothing")
            if backend.name != ep.name:
                raise BackendError(f"entry point {ep.name!r} returned a backend named {backend.name!r}")
            found.append(InstalledBackend(ep.name, dist, backend, None))
        except Exception as exc:
            found.append(InstalledBackend(ep.name, dist, None, f"{type(exc).__name__}: {exc}"))
    return found


def _describe(installed: list[InstalledBackend]) -> str:
    parts = []
    for ib in installed:
        reason = ib.unusable_reason()
        parts.append(f"{ib.name} [{ib.distribution}] ({'usable' if reason is None else 'unusable: ' + reason})")
    return "; ".join(parts) or "none"


def select_backend(name: str | None = None) -> Backend:
    """Return the backend named ``name`` (default: ``DEEPINFER_ACCELERATOR``), or the best usable one.

    Unset: the usable backend with the highest ``auto_priority`` wins (nvidia, then ascend, then cpu);
    the choice and the reason are logged.  Errors name what is installed and why each is unusable.
    """
    name = name if name is not None else envs.accelerator()
    installed = discover()
    by_name: dict[str, list[InstalledBackend]] = {}
    for ib in installed:
        by_name.setdefault(ib.name, []).append(ib)
    clashes = {n: ibs for n, ibs in by_name.items() if len(ibs) > 1}
    if name is None:
        candidates = [
            (ib.backend.auto_priority, ib.backend) for ib in installed
            if ib.name not in clashes and ib.backend is not None and ib.backend.auto_priority is not None
            and ib.unusable_reason() is None
        ]
        if not candidates:
            raise BackendError(f"no usable backend found; installed: {_describe(installed)}")
        _, best = max(candidates, key=lambda c: c[0])  # the first of equals, in name order
        logger.info(
            "DEEPINFER_ACCELERATOR is unset; using backend %r, the highest-priority usable one (installed: %s)",
            best.name, _describe(installed),
        )
        return best
    if name in clashes:
        dists = ", ".join(ib.distribution for ib in clashes[name])
        raise BackendError(f"backend name {name!r} is claimed by more than one distribution ({dists}); "
                           "uninstall all but one")
    if name not in by_name:
        raise BackendError(
            f"DEEPINFER_ACCELERATOR={name!r} names no installed backend; installed: {_describe(installed)}. "
            "Install a backend package (e.g. `pip install deepinfer-backend-cuda`) or pick an installed name."
        )
    (ib,) = by_name[name]
    reason = ib.unusable_reason()
    if ib.backend is None or reason is not None:  # a plugin that failed to load has a reason too
        raise BackendError(f"backend {name!r} [{ib.distribution}] is installed but unusable here: {reason}")
    return ib.backend


@functools.cache
def _cached(name: str | None) -> Backend:
    backend = select_backend(name)
    note = backend.configure_host()
    if note:
        logger.info("backend %r: %s", backend.name, note)
    return backend


def current_backend() -> Backend:
    """The process-wide backend for the current ``DEEPINFER_ACCELERATOR`` (selected once per name)."""
    return _cached(envs.accelerator())
