"""Shared pytest setup: tests run on the backend DEEPINFER_ACCELERATOR names (default: best usable)."""

import logging

logging.getLogger("deepinfer").setLevel(logging.INFO)
