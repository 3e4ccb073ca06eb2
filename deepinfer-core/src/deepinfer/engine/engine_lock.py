"""The engine's lock: one caller at a time, and a clear error where a thread would wait for itself."""

from __future__ import annotations

import threading
from types import TracebackType


class EngineLock:
    """Held by one ``LLM`` call (or the server's engine thread) at a time; a call from another thread waits.

    A ``generate_stream()`` holds it while suspended, so ``generate`` / ``chat`` / another ``generate_stream`` from
    the same thread inside its loop would wait for itself forever: that raises ``RuntimeError`` at once."""

    __slots__ = ("_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> EngineLock:
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError(
                "this thread already holds the engine: a generate_stream() of this LLM is open in it (its loop is "
                "suspended, or it was left unfinished). Finish it or call its close() before calling generate, "
                "chat or generate_stream on the same LLM from this thread")
        self._lock.acquire()
        self._owner = me
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._owner = None
        self._lock.release()

    def locked(self) -> bool:
        """Whether some call holds the engine now."""
        return self._lock.locked()
