"""Run a kernel check under the Triton interpreter in a fresh process (the interpreter is chosen at import)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(script: str, timeout: int = 600) -> str:
    """Run ``script`` with ``TRITON_INTERPRET=1`` (and fp fusion as on the GPU); fail with its output unless it
    exits 0.  Returns its stdout."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout
