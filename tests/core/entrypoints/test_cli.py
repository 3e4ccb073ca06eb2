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


def _serve_args(*argv: str) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    from deepinfer.entrypoints.openai.serve_flags import add_chat_args, add_noop_args

    parser = argparse.ArgumentParser()
    add_chat_args(parser)
    add_noop_args(parser)
    return parser.parse_args(argv), parser


def test_chat_template_must_be_a_file_or_template_text(tmp_path, capsys):
    from deepinfer.entrypoints.cli import main
    from deepinfer.entrypoints.openai.serve_flags import chat_template_arg

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert chat_template_arg(str(template)) == "{{ messages[0]['content'] }}"
    assert chat_template_arg("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(SystemExit) as info:  # refused before the model loads
        main(["serve", "--chat-template", str(tmp_path / "missing.jinja")])
    assert info.value.code == 2 and "missing.jinja" in capsys.readouterr().err


def test_vllm_noop_flags_are_accepted_with_a_note(caplog):
    from deepinfer.entrypoints.openai.serve_flags import check_noop_args

    args, parser = _serve_args("--tensor-parallel-size", "1", "--trust-remote-code", "--disable-log-requests",
                               "--enable-chunked-prefill")
    with caplog.at_level("INFO", logger="deepinfer"):
        check_noop_args(args, parser)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 3 and any("--trust-remote-code has no effect" in n for n in notes)
    args, parser = _serve_args("-tp", "2")
    with pytest.raises(SystemExit):
        check_noop_args(args, parser)


def test_chat_parsers_default_to_the_formats_own():
    from types import SimpleNamespace

    from deepinfer.chat import DeepseekV41Format, JinjaFormat
    from deepinfer.entrypoints.openai.serve_flags import chat_settings

    v41 = SimpleNamespace(chat_format=DeepseekV41Format())
    auto = chat_settings(_serve_args()[0], v41)
    assert (auto["reasoning_parser"], auto["tool_parser"], auto["auto_tool_choice"]) == ("deepseek_v41",) * 2 + (True,)
    off = chat_settings(_serve_args("--reasoning-parser", "none", "--tool-call-parser", "none")[0], v41)
    assert (off["reasoning_parser"], off["tool_parser"], off["auto_tool_choice"]) == (None, None, False)
    jinja = SimpleNamespace(chat_format=JinjaFormat(None, "{{ x }}"))
    assert chat_settings(_serve_args()[0], jinja)["tool_parser"] is None
    forced = chat_settings(_serve_args("--tokenizer-mode", "deepseek_v41", "--tool-call-parser", "deepseek_v41",
                                       "--default-chat-template-kwargs", '{"thinking": true}')[0], jinja)
    assert isinstance(forced["forced_format"], DeepseekV41Format) and forced["auto_tool_choice"]
    assert forced["default_chat_template_kwargs"] == {"thinking": True}
