"""One toy-model server in process per test module (``tests/support/app_client.py``)."""

from __future__ import annotations

import pytest

from tests.support.app_client import client_for, toy_async_engine


@pytest.fixture(scope="module")
def toy_engine():
    engine = toy_async_engine()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(toy_engine):
    with client_for(toy_engine) as c:
        yield c
