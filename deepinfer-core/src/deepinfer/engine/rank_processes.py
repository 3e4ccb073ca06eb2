"""The ranks a parallel ``LLM`` starts itself: fresh interpreters running ``python -m deepinfer.engine.rank_main``.

A rank never re-imports the caller's ``__main__`` (a notebook, ``python -c``, a script on stdin have nothing to
re-import): what it runs travels as a pickle on its stdin (a module-level callable and its arguments, after the
caller's ``sys.path``).  Each rank tells rank 0 where it is in its start-up on a pipe of its own (*joining*
the collectives, *ready*, or *failed* with its exception), and its stderr comes back through rank 0 (each line
prefixed ``(rank r)``; the last lines are kept).  So rank 0 waits for the ranks only while they are alive: a rank
that dies while starting is reported at once with its exception, exit code and last lines on stderr
(:class:`RankStartupError`), never after the rendezvous timeout.  Rank 0 keeps each rank's stdin open; when rank 0
exits (or drops the ranks), the pipe closes and the rank exits too.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

#: Lines of a rank's stderr kept for the error that reports its death.
STDERR_TAIL = 30


class RankStartupError(RuntimeError):
    """A rank this process started died, or did not get ready in time, while the ranks were starting."""


class PeerLink:
    """A started rank's end of its status pipe: it tells rank 0 where it is in its start-up (one JSON line each)."""

    __slots__ = ("_out",)

    def __init__(self, fd: int):
        self._out = os.fdopen(fd, "w", buffering=1)

    def _say(self, event: str, **fields: str) -> None:
        try:
            self._out.write(json.dumps({"event": event, **fields}) + "\n")
        except (OSError, ValueError):  # rank 0 is gone: nobody to tell
            pass

    def joining(self) -> None:
        """About to join the collectives (rank 0 waits for this before it waits in the rendezvous)."""
        self._say("joining")

    def ready(self) -> None:
        """The rank's engine is built; it follows rank 0 from now on."""
        self._say("ready")

    def failed(self, exc: BaseException) -> None:
        self._say("failed", error=f"{type(exc).__name__}: {exc}")


#: What a started rank runs once its process is up: a picklable callable given the rank's :class:`PeerLink`.
PeerMain = Callable[[PeerLink], None]


class PeerProcess:
    """A rank this process started: the process, what it said on its status pipe, its last lines on stderr."""

    def __init__(self, rank: int, world_size: int, proc: subprocess.Popen[bytes], status: IO[bytes],
                 changed: threading.Condition):
        self.rank, self.world_size, self.proc = rank, world_size, proc
        self.events: set[str] = set()
        self.error: str | None = None
        self.tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self.changed = changed  # shared by the ranks of one start: a waiter wakes on any rank's news
        self._readers = [threading.Thread(target=self._read_status, args=(status,), daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for reader in self._readers:
            reader.start()

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout_s: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.is_alive():
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Close the rank's stdin: a rank still running exits (rank 0 is letting it go)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def _read_status(self, status: IO[bytes]) -> None:
        with status:
            for line in status:
                try:
                    news = json.loads(line)
                except ValueError:
                    continue
                with self.changed:
                    self.events.add(str(news.get("event")))
                    self.error = news.get("error", self.error)
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            for raw in self.proc.stderr:
                line = raw.decode(errors="replace").rstrip("\n")
                self.tail.append(line)
                with contextlib.suppress(OSError, ValueError):  # our own stderr closed: keep the tail anyway
                    print(f"(rank {self.rank}) {line}", file=sys.stderr, flush=True)
        with self.changed:
            self.changed.notify_all()

    def failure(self) -> str:
        """Why this rank ended: its exit code (or signal), its exception, its last lines on stderr."""
        for reader in self._readers:  # what it wrote before dying is still in the pipes
            reader.join(2.0)
        code = self.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        lines = "\n".join(f"    {line}" for line in self.tail)
        return (f"rank {self.rank} of {self.world_size} {how}"
                + (f": {self.error}" if self.error else "")
                + (f"\n  its last lines on stderr:\n{lines}" if lines else ""))


def start_peers(world_size: int, master_port: int, peer_main: PeerMain) -> list[PeerProcess]:
    """Start ranks ``1 .. world_size - 1`` on this host, each running ``peer_main`` (after torchrun's variables
    are set for it and the caller's ``sys.path`` is restored)."""
    try:
        payload = pickle.dumps(list(sys.path)) + pickle.dumps(peer_main)
    except Exception as exc:
        raise TypeError(f"cannot send what a rank runs to the new ranks ({type(exc).__name__}: {exc}); "
                        "LLM's arguments must be picklable") from exc
    package_root = str(Path(__file__).resolve().parents[2])  # where this deepinfer is: the ranks import the same
    changed = threading.Condition()
    peers: list[PeerProcess] = []
    for rank in range(1, world_size):
        env = {**os.environ, "WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
               "PYTHONPATH": os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        read, write = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-m", "deepinfer.engine.rank_main", str(write)], env=env,
                                    stdin=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(write,))
        finally:
            os.close(write)
        peers.append(PeerProcess(rank, world_size, proc, os.fdopen(read, "rb"), changed))
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died before reading: reported by wait_for
            proc.stdin.write(payload)
            proc.stdin.flush()
    return peers


def wait_for(peers: list[PeerProcess], event: str, timeout_s: float) -> None:
    """Wait until every rank has said ``event`` (``joining`` or ``ready``); a rank that dies first, or says it
    failed, raises :class:`RankStartupError` at once; so does ``timeout_s`` passing."""
    if not peers:
        return
    changed = peers[0].changed
    deadline = time.monotonic() + timeout_s
    with changed:
        while True:
            dead = [p for p in peers if "failed" in p.events or (event not in p.events and not p.is_alive())]
            if dead:
                break
            late = [p.rank for p in peers if event not in p.events]
            if not late:
                return
            if time.monotonic() > deadline:
                raise RankStartupError(f"ranks {late} did not get to '{event}' within {timeout_s:g} s "
                                       "(distributed_timeout)")
            changed.wait(0.2)
    dead[0].join(5.0)  # a rank that said it failed is exiting: its exit code and stderr complete the report
    raise RankStartupError(f"a rank failed while the ranks were starting: {dead[0].failure()}")


def stop_all(peers: list[PeerProcess], grace_s: float = 2.0) -> None:
    """Let the ranks go (start-up failed, they are out of step, or rank 0 is leaving): close their stdin, on which
    they exit at once, and kill those still running after ``grace_s``."""
    for proc in peers:
        proc.close()
    deadline = time.monotonic() + grace_s
    for proc in peers:
        proc.join(max(0.0, deadline - time.monotonic()))
        proc.kill()


@contextlib.contextmanager
def reporting_dead_peers(peers: list[PeerProcess]) -> Iterator[None]:
    """Rank 0's start-up while its ranks start: if it fails, the ranks are stopped, and a rank that died is
    named as the cause (rank 0's own error, e.g. a collective that lost its peer, stays attached)."""
    try:
        yield
    except BaseException as exc:
        dead = next((p for p in peers if not p.is_alive() or "failed" in p.events), None)
        report = dead.failure() if dead is not None else None
        stop_all(peers)
        if report is not None and not isinstance(exc, RankStartupError):
            raise RankStartupError(f"a rank failed while the ranks were starting: {report}") from exc
        raise


def exit_with_parent(stdin: IO[bytes]) -> None:
    """In a started rank: exit as soon as rank 0 closes our stdin (it exited, or let this rank go)."""
    fd = stdin.fileno()  # read raw: a daemon thread must not hold the buffered reader's lock at exit

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 1 << 16):
                pass
        os._exit(0)

    threading.Thread(target=watch, name="deepinfer-rank0-watch", daemon=True).start()


def read_payload(stdin: IO[bytes]) -> Any:
    """In a started rank: the caller's ``sys.path`` restored, then what to run."""
    sys.path[:] = pickle.load(stdin)
    try:
        return pickle.load(stdin)
    except (AttributeError, ImportError) as exc:
        raise pickle.UnpicklingError(
            f"this rank cannot rebuild LLM's arguments ({type(exc).__name__}: {exc}): a new interpreter finds "
            "classes and functions by module name, so none may come from a notebook's or a script's __main__") from exc
