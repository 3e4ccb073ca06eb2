"""The ``deepinfer`` command: engine flags mirror ``EngineArgs``; the console script is declared."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from deepinfer.engine.args import EngineArgs
from deepinfer.entrypoints.engine_flags import add_engine_args, engine_kwargs

ROOT = Path(__file__).resolve().parents[3]


def _parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_kwargs(parser.parse_args(argv))


def test_every_engine_arg_has_a_flag_and_only_given_flags_are_passed():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(EngineArgs)} <= flags
    assert _parse() == {}  # EngineArgs keeps its own defaults
    kwargs = _parse("some/model", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.5", "--no-async-scheduling",
                    "--enforce-eager", "--dtype", "float32", "--max-model-len", "512")
    assert kwargs == {"model": "some/model", "max_num_seqs": 4, "gpu_memory_utilization": 0.5,
                      "async_scheduling": False, "enforce_eager": True, "dtype": "float32", "max_model_len": 512}
    EngineArgs(**kwargs)  # what the CLI passes is what EngineArgs takes
    with pytest.raises(SystemExit):
        _parse("--max-num-seqs", "four")


def test_console_script_and_module_entry():
    project = tomllib.loads((ROOT / "deepinfer-core" / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["deepinfer"] == "deepinfer.entrypoints.cli:main"
    result = subprocess.run([sys.executable, "-m", "deepinfer", "serve", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "--max-num-seqs" in result.stdout and "--served-model-name" in result.stdout


def test_bad_flag_exits_with_usage(capsys):
    from deepinfer.entrypoints.cli import main

    with pytest.raises(SystemExit) as info:
        main(["bench", "serve", "--max-concurrency", "x"])
    assert info.value.code == 2 and "--max-concurrency" in capsys.readouterr().err


def test_bad_engine_value_is_a_usage_error_before_loading(capsys):
    from deepinfer.entrypoints.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--max-num-seqs", "0"])
    assert info.value.code == 2 and "max_num_seqs" in capsys.readouterr().err
