"""Who may use the server: an API key for ``/v1/*``, and a Host-header check against DNS rebinding.

- ``--api-key`` (else ``DEEPINFER_API_KEY``): every ``/v1/*`` request needs ``Authorization: Bearer <key>``
  (401 otherwise, compared in constant time); ``/health``, ``/metrics`` and ``/version`` stay open, as in vLLM.
- A server bound to a loopback address answers only requests whose ``Host`` names a loopback host
  (``localhost``, ``127.0.0.1``, ``[::1]``, any port): a web page whose domain an attacker re-points at
  127.0.0.1 (DNS rebinding) sends its own domain as ``Host`` and gets a 403.  ``--allowed-hosts`` replaces that
  list on any bind (``*``: no check), e.g. for a reverse proxy that forwards its public name.
- Binding a non-loopback address without a key logs a warning: anyone who reaches the port can use the model.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from deepinfer import envs

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def hostname(host: str) -> str:
    """The name of a ``Host`` header value, without port or IPv6 brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(host: str) -> bool:
    name = hostname(host).rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """Which ``Host`` headers the server answers: ``names`` (None: any), and with ``loopback`` any loopback name."""

    names: frozenset[str] | None
    loopback: bool = False

    @classmethod
    def for_bind(cls, bind_host: str, allowed: str | None) -> HostPolicy:
        """``allowed`` is ``--allowed-hosts`` (comma-separated names, ``*`` for any); by default a loopback bind
        answers loopback names only and any other bind answers any name."""
        if allowed is not None:
            names = frozenset(hostname(h) for h in allowed.split(",") if h.strip())
            return cls(None if "*" in names else names)
        return cls(frozenset(), loopback=True) if is_loopback(bind_host) else cls(None)

    def allows(self, host: str | None) -> bool:
        """A request without ``Host`` (HTTP/1.0) is no browser's, so DNS rebinding cannot send it."""
        if self.names is None or host is None:
            return True
        return hostname(host) in self.names or (self.loopback and is_loopback(host))

    def describe(self) -> str:
        return ", ".join([*(["loopback names"] if self.loopback else []), *sorted(self.names or ())])


def api_key(flag: str | None) -> str | None:
    """``--api-key``, else ``DEEPINFER_API_KEY``, else None (no key)."""
    return flag or envs.api_key()


def warn_if_exposed(bind_host: str, key: str | None) -> None:
    if key is None and not is_loopback(bind_host):
        where = "every interface" if bind_host in ("", "0.0.0.0", "::") else bind_host
        logger.warning("serving on %s without an API key: anyone who can reach this port can use the model; pass "
                       "--api-key (or set DEEPINFER_API_KEY)", where)


class AccessGuard:
    """ASGI middleware applying the Host check and the API key (see the module docstring)."""

    def __init__(self, app: ASGIApp, key: str | None, hosts: HostPolicy):
        self.app, self.key, self.hosts = app, key, hosts

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        host = headers.get("host")
        if not self.hosts.allows(host):
            return await _refuse(send, 403, f"Host {host!r} is not allowed: this server answers "
                                 f"{self.hosts.describe()} (--allowed-hosts)")
        path = scope["path"]
        if self.key is not None and (path == "/v1" or path.startswith("/v1/")) and not self._authorized(headers):
            return await _refuse(send, 401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                                 [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        assert self.key is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key.encode())


async def _refuse(send: Callable[[Any], Awaitable[None]], status: int, message: str,
                  extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(extra or [])]})
    await send({"type": "http.response.body", "body": body})
