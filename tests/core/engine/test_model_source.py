"""Model resolution: local dirs, repo ids (offline here), DEEPINFER_HF_MODEL_DIR, cached default, embedded model."""

from __future__ import annotations

import json
import logging

import pytest

from deepinfer.engine import model_source
from deepinfer.engine.model_source import DEFAULT_MODEL, ModelSourceError, resolve_model


def _checkpoint(path, model_type="deepseek_v4"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty HF cache with the hub switched off, whatever the machine's network."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    return cache


def test_local_directory(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    src = resolve_model(ckpt)
    assert src.path == ckpt and src.origin == "local directory"
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ModelSourceError, match="neither an existing directory nor a Hugging Face repo id"):
        resolve_model(str(tmp_path / "missing"))


def test_repo_id_without_network_says_how_to_use_local_weights(offline_hub):
    with pytest.raises(ModelSourceError) as info:
        resolve_model("some-org/some-model")
    message = str(info.value)
    assert "could not fetch 'some-org/some-model'" in message
    assert "DEEPINFER_HF_MODEL_DIR" in message and "LLM(model=" in message


def test_repo_id_found_in_the_cache_offline(offline_hub):
    snap = _checkpoint(offline_hub / "models--some-org--some-model" / "snapshots" / "abc123")
    (offline_hub / "models--some-org--some-model" / "refs").mkdir()
    (offline_hub / "models--some-org--some-model" / "refs" / "main").write_text("abc123")
    assert resolve_model("some-org/some-model").path == snap


def test_env_dir_overrides_the_default(offline_hub, tmp_path, monkeypatch):
    ckpt = _checkpoint(tmp_path / "env_ckpt")
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(ckpt))
    src = resolve_model(None)
    assert src.path == ckpt and src.origin == "DEEPINFER_HF_MODEL_DIR"
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path / "nope"))
    with pytest.raises(ModelSourceError, match="DEEPINFER_HF_MODEL_DIR"):
        resolve_model(None)


def test_default_repo_used_when_cached(offline_hub):
    repo_dir = offline_hub / ("models--" + DEFAULT_MODEL.replace("/", "--"))
    snap = _checkpoint(repo_dir / "snapshots" / "f00d", model_type="deepseek_v41")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("f00d")
    src = resolve_model(None)
    assert src.path == snap and DEFAULT_MODEL in src.origin


def test_embedded_fallback_is_logged_once(offline_hub, tmp_path, monkeypatch, caplog):
    embedded = _checkpoint(tmp_path / "tiny_v4")
    monkeypatch.setattr(model_source, "EMBEDDED_MODEL_DIR", embedded)
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        src = resolve_model(None)
    assert src.path == embedded and src.origin == "embedded"
    lines = [r.message for r in caplog.records if "embedded tiny" in r.message]
    assert len(lines) == 1 and "DEEPINFER_HF_MODEL_DIR" in lines[0]
    monkeypatch.setattr(model_source, "EMBEDDED_MODEL_DIR", tmp_path / "absent")
    with pytest.raises(ModelSourceError, match="embedded tiny model is missing"):
        resolve_model(None)


def test_shipped_embedded_model_is_found_when_present(offline_hub):
    if not (model_source.EMBEDDED_MODEL_DIR / "config.json").is_file():
        pytest.skip("the tiny_v4 asset is not in this checkout yet")
    assert resolve_model(None).origin == "embedded"
