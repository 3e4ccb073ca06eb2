"""``python -m deepinfer.engine.rank_main STATUS_FD``: one rank a parallel ``LLM`` started (rank_processes.py).

torchrun's variables are in its environment; its stdin carries the caller's ``sys.path`` and what to run (a
pickled module-level callable, e.g. ``LLM``'s: build the same ``LLM``, then follow rank 0).  A failure is told to
rank 0 on the status pipe ``STATUS_FD`` before the traceback goes to stderr.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback


def main(argv: list[str]) -> int:
    from deepinfer.engine.rank_processes import PeerLink, exit_with_parent, read_payload

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops the ranks in order
    link = PeerLink(int(argv[0]))
    try:
        peer_main = read_payload(sys.stdin.buffer)
        exit_with_parent(sys.stdin.buffer)
        from deepinfer.host_threads import share_host_threads

        share_host_threads(int(os.environ["WORLD_SIZE"]))
        peer_main(link)
    except BaseException as exc:  # noqa: BLE001 - told to rank 0, then the usual traceback and exit status
        link.failed(exc)
        traceback.print_exc()
        return 1
    return 0


def _exit(status: int) -> None:
    """Exit without finalizing the interpreter: the collectives' threads would abort it (``terminate called``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))
