"""Structured output is in every install: xgrammar is a dependency of deepinfer-core, and an environment that lost
it gets an error naming the package, not a bare ModuleNotFoundError."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[3] / "deepinfer-core" / "pyproject.toml"


def test_xgrammar_is_a_core_dependency():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert any(dep.startswith("xgrammar") for dep in project["dependencies"])
    assert project["optional-dependencies"].get("structured", []) == []  # kept as an alias only


def test_so_args_without_xgrammar_names_the_package():
    code = (
        "import sys\n"
        "sys.modules['xgrammar'] = None  # as if it were not installed\n"
        "from deepinfer import SamplingParams\n"
        "try:\n"
        "    SamplingParams(so_args={'regex': 'a+'})\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc.name, exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("ModuleNotFoundError xgrammar structured output (SamplingParams(so_args=...)) needs the "
                          "'xgrammar' package"), out
    assert "pip install 'xgrammar" in out
