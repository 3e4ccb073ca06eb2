"""The example third-party backend, installed for real and selected by DEEPINFER_ACCELERATOR."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "third_party_backend"


def _install(source: Path, target: Path) -> Path:
    """pip-install ``source`` into a private target dir (its entry point lands in a real .dist-info)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True, capture_output=True,
    )
    assert any(p.name.startswith("deepinfer_backend_example-") for p in target.iterdir())
    return target


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory) -> Path:
    return _install(EXAMPLE, tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def installed_wrong_signature(tmp_path_factory) -> Path:
    """The example with one slip: its ``rms_norm`` names the reference's ``eps`` parameter ``epsilon``."""
    source = tmp_path_factory.mktemp("wrong_example") / "example"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    plugin = source / "src" / "deepinfer_example_backend" / "plugin.py"
    text = plugin.read_text()
    assert "weight: torch.Tensor | None, eps: float)" in text, "the example's rms_norm changed: update this test"
    plugin.write_text(re.sub(r"\beps\b", "epsilon", text))
    return _install(source, tmp_path_factory.mktemp("wrong_site"))


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


def test_a_wrong_override_signature_is_rejected_with_both_signatures(installed_wrong_signature):
    """Selecting the backend and building an LLM fails before any weight loads, naming the op and both signatures."""
    proc = _run(installed_wrong_signature, "example", """
        from deepinfer import LLM
        LLM()
    """)
    assert proc.returncode != 0
    assert ("TypeError: backend 'example' overrides op 'rms_norm' with signature (x, weight, epsilon), but the "
            "reference deepinfer.ops.norm.rms_norm takes (x, weight, eps)") in proc.stderr, proc.stderr[-3000:]
