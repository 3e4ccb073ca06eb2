"""The ``deepinfer`` logger's default handler, so a plain script sees DeepInfer's one-line notices.

As in vLLM, importing ``deepinfer`` gives the ``deepinfer`` logger a stderr handler and the level of
``DEEPINFER_LOGGING_LEVEL`` (default ``INFO``).  Unlike vLLM, records still propagate: the handler prints only
while the root logger has no handler of its own, so once the application calls ``logging.basicConfig`` (or
pytest's ``caplog`` / log capture is active) records go to those handlers alone and nothing prints twice.
"""

from __future__ import annotations

import logging

from deepinfer import envs

LOGGER_NAME = "deepinfer"
_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"


class DefaultHandler(logging.StreamHandler):
    """Writes to stderr unless the root logger has a handler (the application configured logging)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        super().emit(record)


def configure_logging() -> None:
    """Give the ``deepinfer`` logger its default handler (once) and its level.

    The level comes from ``DEEPINFER_LOGGING_LEVEL`` when set; unset, ``INFO`` unless the application already
    chose a level for the logger.  An invalid value leaves ``INFO`` here: ``LLM(...)`` reports it
    (``envs.validate``), since import time is no place to raise.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, DefaultHandler) for h in logger.handlers):
        handler = DefaultHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
        logger.addHandler(handler)
    try:
        level = envs.logging_level()
    except ValueError:
        level = logging.INFO
    if envs.is_set("DEEPINFER_LOGGING_LEVEL") or logger.level == logging.NOTSET:
        logger.setLevel(level)
