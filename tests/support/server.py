"""A ``deepinfer serve`` subprocess on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(*args: str, timeout: float = 180.0, log: Path | None = None) -> Iterator[str]:
    """``python -m deepinfer serve ARGS`` on the embedded model (CPU, offline); yields its base URL."""
    import httpx

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_HF_MODEL_DIR"}
    env.update(DEEPINFER_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # closed in the finally below
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer", "serve", "--port", str(port), *args], env=env,
                            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"deepinfer serve exited with {proc.returncode}"
                                   + (f"; log:\n{log.read_text()[-3000:]}" if log else ""))
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"deepinfer serve did not come up within {timeout} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if out is not subprocess.DEVNULL:
            out.close()


def metric_key(name: str, **labels: str) -> str:
    """``name{a="x",b="y"}`` with the labels sorted: how :func:`parse_metrics` names a sample."""
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric_key(name, **labels): value}; raises on a line that is neither a comment nor a
    sample."""
    import re

    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            assert not line or line.startswith(("# HELP ", "# TYPE ")), line
            continue
        m = sample.match(line)
        assert m is not None, f"not a Prometheus sample: {line!r}"
        values[metric_key(m.group(1), **dict(label.findall(m.group(2) or "")))] = float(m.group(3))
    return values
