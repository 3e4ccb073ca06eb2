"""The OpenAI server in process (Starlette's TestClient) over a toy model: fast enough for request-shape tests."""

from __future__ import annotations

from typing import Any

from deepinfer import LLM
from deepinfer.engine.async_llm import AsyncLLM
from deepinfer.entrypoints.openai.api_server import build_app
from deepinfer.entrypoints.openai.limits import ServerLimits
from deepinfer.entrypoints.openai.security import HostPolicy
from deepinfer.entrypoints.openai.state import ServerState
from tests.support.toy_model import ToyCausalLM, toy_tokenizer


def toy_async_engine(model_cls: type[ToyCausalLM] = ToyCausalLM, tokenizer: Any = None, **kwargs: Any) -> AsyncLLM:
    """An ``AsyncLLM`` over a toy model (``model_cls``) and the toy tokenizer (or ``tokenizer``)."""
    tok = tokenizer if tokenizer is not None else toy_tokenizer()
    return AsyncLLM(LLM.from_model(model_cls(len(tok), seed=5), tok, **{"max_num_seqs": 8, **kwargs}))


def client_for(engine: AsyncLLM, limits: ServerLimits | None = None, key: str | None = None,
               hosts: HostPolicy | None = None):
    """A TestClient of the app over ``engine`` (served name ``toy``); server errors become 500 responses."""
    from fastapi.testclient import TestClient

    state = ServerState(engine, "toy", limits=limits or ServerLimits())
    return TestClient(build_app(state, key, hosts), raise_server_exceptions=False)


def assert_error(response: Any, status: int, param: str | None) -> dict[str, Any]:
    """``response`` is OpenAI's error shape with this status and ``param``; returns its ``error``."""
    body = response.json()
    assert response.status_code == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    assert error["param"] == param, error
    return error
