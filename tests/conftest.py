"""Shared pytest setup: tests run on the backend DEEPINFER_ACCELERATOR names (default: best usable)."""

import logging

import deepinfer  # noqa: F401  (first, before torch: it asks OpenMP for passive waiting; deepinfer.host_threads)

logging.getLogger("deepinfer").setLevel(logging.INFO)
