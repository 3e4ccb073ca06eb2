"""The example third-party backend, installed for real and selected by DEEPINFER_ACCELERATOR."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "third_party_backend"


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory) -> Path:
    """pip-install the example into a private target dir (its entry point lands in a real .dist-info)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(EXAMPLE)],
        check=True, capture_output=True,
    )
    assert any(p.name.startswith("deepinfer_backend_example-") for p in target.iterdir())
    return target


def _run(site: Path, accelerator: str, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "DEEPINFER_ACCELERATOR": accelerator}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)


def test_selected_through_entry_point_and_its_op_runs(installed_example):
    proc = _run(installed_example, "example", """
        import torch
        from deepinfer.backends import current_backend
        from deepinfer.ops import OpTable
        from deepinfer_example_backend.plugin import CALLS
        backend = current_backend()
        table = OpTable.for_backend(backend)
        x = torch.randn(3, 8)
        y = table.rms_norm(x, None, 1e-6)
        print(backend.name, table.source("rms_norm"), CALLS["rms_norm"])
        torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    """)
    assert proc.returncode == 0, proc.stderr
    name, source, calls = proc.stdout.split()
    assert (name, source, calls) == ("example", "example", "1")


def test_passes_the_conformance_suite(installed_example):
    proc = _run(installed_example, "example", """
        from deepinfer.backends import current_backend
        from deepinfer.testing import check_backend
        from deepinfer_example_backend.plugin import CALLS
        counts = check_backend(current_backend())
        print(sorted(counts), CALLS["rms_norm"] == sum(counts.values()))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['rms_norm'] True"


def test_not_picked_implicitly(installed_example):
    proc = _run(installed_example, "", """
        from deepinfer.backends import select_backend
        print(select_backend().name)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() != "example"
