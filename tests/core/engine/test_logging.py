"""DeepInfer's notices reach a plain script's stderr once, at DEEPINFER_LOGGING_LEVEL, and pytest's caplog."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from deepinfer.logger import DefaultHandler

SCRIPT = """
import logging, sys
import deepinfer
{configure}
logging.getLogger("deepinfer.engine.llm").info("notice: model X on backend Y")
logging.getLogger("deepinfer.engine.llm").warning("warning: something odd")
"""


def _stderr(configure: str = "", **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "DEEPINFER_LOGGING_LEVEL"} | env
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(configure=configure)], capture_output=True,
                            text=True, timeout=60, env=environ)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_a_plain_script_sees_info_notices():
    err = _stderr()
    assert err.count("notice: model X on backend Y") == 1 and "INFO" in err and "[deepinfer.engine.llm]" in err


def test_level_from_the_environment():
    err = _stderr(DEEPINFER_LOGGING_LEVEL="warning")
    assert "notice" not in err and err.count("warning: something odd") == 1
    assert "notice: model X" in _stderr(DEEPINFER_LOGGING_LEVEL="DEBUG")


def test_an_invalid_level_leaves_info_at_import():
    assert "notice: model X" in _stderr(DEEPINFER_LOGGING_LEVEL="LOUD")  # LLM(...) reports it (envs.validate)


def test_an_application_that_configures_logging_gets_each_notice_once():
    err = _stderr('logging.basicConfig(stream=sys.stderr, format="APP %(message)s")')
    assert err.count("notice: model X") == 1 and "APP notice: model X" in err


def test_handler_is_added_once_and_stays_quiet_under_pytests_root_handlers(capsys, caplog):
    import deepinfer.logger

    deepinfer.logger.configure_logging()
    handlers = [h for h in logging.getLogger("deepinfer").handlers if isinstance(h, DefaultHandler)]
    assert len(handlers) == 1
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        logging.getLogger("deepinfer.test").info("captured notice")
    assert "captured notice" in caplog.text
    assert "captured notice" not in capsys.readouterr().err


@pytest.mark.parametrize("root_handlers, printed", [(False, True), (True, False)])
def test_default_handler_prints_only_without_root_handlers(monkeypatch, root_handlers, printed):
    import io

    stream = io.StringIO()
    handler = DefaultHandler(stream)
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()] if root_handlers else [])
    handler.handle(logging.LogRecord("deepinfer.x", logging.INFO, __file__, 1, "hello", None, None))
    assert ("hello" in stream.getvalue()) is printed
