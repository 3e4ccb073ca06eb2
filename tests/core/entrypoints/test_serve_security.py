"""Who may use the server: the API key on ``/v1/*`` (flag or ``DEEPINFER_API_KEY``), the Host check against DNS
rebinding on loopback binds, and the warning for a server exposed without a key."""

from __future__ import annotations

import logging

import pytest

from deepinfer.entrypoints.openai.security import HostPolicy, api_key, hostname, warn_if_exposed
from tests.support.app_client import assert_error, client_for

BODY = {"prompt": "Once", "max_tokens": 1}


@pytest.fixture(scope="module")
def keyed(toy_engine):
    with client_for(toy_engine, key="s3cret") as c:
        yield c


def test_v1_needs_the_key_and_the_probes_do_not(keyed):
    missing = keyed.post("/v1/completions", json=BODY)
    assert "API key" in assert_error(missing, 401, None)["message"]
    assert missing.headers["www-authenticate"] == "Bearer"
    assert_error(keyed.post("/v1/completions", json=BODY, headers={"authorization": "Bearer wrong"}), 401, None)
    assert_error(keyed.get("/v1/models", headers={"authorization": "Basic s3cret"}), 401, None)
    assert keyed.post("/v1/completions", json=BODY, headers={"authorization": "Bearer s3cret"}).status_code == 200
    assert keyed.get("/v1/models", headers={"authorization": "bearer s3cret"}).status_code == 200
    for path in ("/health", "/metrics", "/version"):
        assert keyed.get(path).status_code == 200


def test_the_flag_wins_over_the_environment(monkeypatch):
    monkeypatch.delenv("DEEPINFER_API_KEY", raising=False)
    assert api_key(None) is None
    monkeypatch.setenv("DEEPINFER_API_KEY", " from-env\n")
    assert api_key(None) == "from-env" and api_key("from-flag") == "from-flag"


@pytest.mark.parametrize(("host", "allowed"), [
    ("localhost:8000", True), ("127.0.0.1:8000", True), ("[::1]:8000", True), ("127.0.0.2", True),
    ("LOCALHOST", True), ("app.localhost:8000", True), ("attacker.example:8000", False),
    ("attacker.example", False), ("10.0.0.5:8000", False), ("127.0.0.1.attacker.example", False),
])
def test_a_loopback_bind_answers_loopback_names_only(toy_engine, host, allowed):
    with client_for(toy_engine, hosts=HostPolicy.for_bind("127.0.0.1", None)) as c:
        response = c.get("/v1/models", headers={"host": host})
        if allowed:
            assert response.status_code == 200
        else:
            assert "--allowed-hosts" in assert_error(response, 403, None)["message"]
            assert_error(c.get("/metrics", headers={"host": host}), 403, None)  # every route


def test_allowed_hosts_and_other_binds():
    assert HostPolicy.for_bind("0.0.0.0", None).allows("anything.example:1")
    assert HostPolicy.for_bind("::1", None) == HostPolicy.for_bind("localhost", None) == HostPolicy(frozenset(), True)
    listed = HostPolicy.for_bind("127.0.0.1", "api.example.com, proxy:8080")
    assert listed.allows("api.example.com:443") and listed.allows("proxy") and not listed.allows("localhost")
    assert HostPolicy.for_bind("127.0.0.1", "*").allows("attacker.example")
    assert HostPolicy.for_bind("127.0.0.1", None).allows(None)  # HTTP/1.0 without Host: no browser
    assert [hostname(h) for h in ("[::1]:80", "::1", "Example.COM:80", "a")] == ["::1", "::1", "example.com", "a"]


@pytest.mark.parametrize(("host", "key", "warned"), [
    ("0.0.0.0", None, True), ("::", None, True), ("192.168.1.4", None, True), ("0.0.0.0", "k", False),
    ("127.0.0.1", None, False), ("localhost", None, False),
])
def test_an_exposed_server_without_a_key_warns(caplog, host, key, warned):
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        warn_if_exposed(host, key)
    assert any("without an API key" in r.getMessage() for r in caplog.records) == warned


def test_deepinfer_serve_wires_the_key_the_host_check_and_the_limits(monkeypatch, caplog):
    """``deepinfer serve`` up to ``uvicorn.run`` (patched), on a toy model: the flags reach the app."""
    import uvicorn

    from deepinfer import LLM
    from deepinfer.entrypoints.cli import main
    from tests.support.toy_model import ToyCausalLM, toy_tokenizer

    tok = toy_tokenizer()
    monkeypatch.setattr("deepinfer.engine.llm.LLM", lambda **_: LLM.from_model(ToyCausalLM(len(tok), seed=5), tok))
    served: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    monkeypatch.setenv("DEEPINFER_API_KEY", "from-env")
    main(["serve", "--api-key", "k", "--max-stop-sequences", "2", "--port", "8123"])
    assert served["host"] == "127.0.0.1" and served["port"] == 8123

    from fastapi.testclient import TestClient

    with TestClient(served["app"], base_url="http://localhost:8123") as c:
        auth = {"authorization": "Bearer k"}
        assert_error(c.get("/v1/models", headers={"authorization": "Bearer from-env"}), 401, None)
        assert c.get("/v1/models", headers=auth).status_code == 200
        assert_error(c.get("/v1/models", headers={**auth, "host": "attacker.example:8123"}), 403, None)
        stops = c.post("/v1/completions", json={"prompt": "a", "stop": ["x", "y", "z"]}, headers=auth)
        assert "--max-stop-sequences" in assert_error(stops, 400, "stop")["message"]

    monkeypatch.delenv("DEEPINFER_API_KEY")
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        main(["serve", "--host", "0.0.0.0"])
    assert any("every interface without an API key" in r.getMessage() for r in caplog.records)
    with TestClient(served["app"], base_url="http://anything.example") as c:
        assert c.get("/v1/models").status_code == 200  # no key, any Host: what the warning said
