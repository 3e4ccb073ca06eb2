"""Model resolution: local dirs, repo ids (offline here), DEEPINFER_HF_MODEL_DIR, cached default, embedded model."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

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


def _weights(path, shards=None):
    """A loadable-looking checkpoint: config.json and one safetensors file (or an index of ``shards``, absent)."""
    from safetensors.torch import save_file

    _checkpoint(path, model_type="deepseek_v41")
    save_file({"embed.weight": torch.zeros(2, 2)}, str(path / "model.safetensors"))
    if shards is not None:
        weight_map = {f"t{i}": name for i, name in enumerate(shards)}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_default_repo_used_when_cached(offline_hub, tmp_path, caplog):
    from tests.support.hf_cache import add_snapshot, commit_hash

    snap = add_snapshot(offline_hub, DEFAULT_MODEL, commit_hash("f00d"), _weights(tmp_path / "w"), ("main",))
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        src = resolve_model(None)
    assert src.path == snap and DEFAULT_MODEL in src.origin and src.commit == commit_hash("f00d")
    assert any(f"{DEFAULT_MODEL}: using commit {src.commit}" in r.message for r in caplog.records)


def test_any_cached_revision_of_the_released_repo_is_used(offline_hub, tmp_path, caplog):
    """``deepseek-ai/DeepSeek-V4.1-Flash`` (not our default's dated name), fetched by commit (no ref names it); an
    incomplete revision is skipped, saying so; the default repo wins over others, ``main`` over a newer one."""
    from tests.support.hf_cache import add_snapshot, commit_hash

    released = "deepseek-ai/DeepSeek-V4.1-Flash"
    add_snapshot(offline_hub, released, commit_hash("partial"), _weights(tmp_path / "p", ["model-00001.safetensors"]))
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        assert resolve_model(None).origin == "embedded"
    assert any(f"{released}@{commit_hash('partial')} in the HF cache is incomplete (1 of 1 shards missing)"
               in r.message for r in caplog.records)
    snap = add_snapshot(offline_hub, released, commit_hash("dba1be0a"), _weights(tmp_path / "r"))
    assert resolve_model(None).path == snap
    main = add_snapshot(offline_hub, released, commit_hash("older"), _weights(tmp_path / "o"), ("main",))
    os.utime(main, (1, 1))  # older than the other revision, but main names it
    assert resolve_model(None).path == main
    default = add_snapshot(offline_hub, DEFAULT_MODEL, commit_hash("1017"), _weights(tmp_path / "d"))
    assert resolve_model(None).path == default
    add_snapshot(offline_hub, "deepseek-ai/DeepSeek-V4-Flash", commit_hash("v4"), _weights(tmp_path / "v4"))
    assert resolve_model(None).path == default


def test_downloads_fetch_the_index_and_encoding_files():
    from huggingface_hub.utils import filter_repo_objects

    files = ["config.json", "model.safetensors.index.json", "model-00001-of-00048.safetensors", "tokenizer.json",
             "tokenizer_config.json", "encoding/encoding.py", "encoding/README.md",
             "encoding/tests/test_input_1.json", "encoding/tests/test_output_1.txt", "inference/model.py",
             "inference/convert.py", "DeepSeek_V4_1.pdf", "model.bin"]
    fetched = set(filter_repo_objects(files, allow_patterns=model_source.CHECKPOINT_PATTERNS))
    assert fetched == set(files) - {"inference/model.py", "inference/convert.py", "DeepSeek_V4_1.pdf", "model.bin"}


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


# --- provenance: the commit used is logged and kept; revision= pins it -----------------------------------------


def _two_commits(cache, tmp_path, repo="some-org/pinned"):
    """Snapshots ``old`` (also tag v1) and ``new`` (main) of ``repo``, each a checkpoint of its own model_type
    marker, stored as the hub stores them: symlinks into the blob store."""
    from tests.support.hf_cache import add_snapshot, commit_hash

    commits = {}
    for label, refs in (("old", ("v1",)), ("new", ("main",))):
        source = _checkpoint(tmp_path / f"src_{label}")
        (source / "generation_config.json").write_text(json.dumps({"label": label}))
        commits[label] = commit_hash(label)
        add_snapshot(cache, repo, commits[label], source, refs)
    return repo, commits


def test_hub_commit_is_logged_and_kept(offline_hub, tmp_path, caplog):
    repo, commits = _two_commits(offline_hub, tmp_path)
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        src = resolve_model(repo)
    assert src.commit == commits["new"] and src.path.name == commits["new"]
    assert f"{repo}@{commits['new']}" in src.origin
    assert any(f"{repo}: using commit {commits['new']}" in r.message for r in caplog.records)
    assert json.loads((src.path / "generation_config.json").read_text())["label"] == "new"


@pytest.mark.parametrize("pin", ["commit", "tag", "branch"])
def test_revision_pins_the_snapshot(offline_hub, tmp_path, caplog, pin):
    repo, commits = _two_commits(offline_hub, tmp_path)
    revision = {"commit": commits["old"], "tag": "v1", "branch": "main"}[pin]
    expected = commits["new"] if pin == "branch" else commits["old"]
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        src = resolve_model(repo, revision=revision)
    assert src.commit == expected and src.path.name == expected
    assert any(f"using commit {expected} (revision {revision!r})" in r.message for r in caplog.records)


def test_revision_errors(offline_hub, tmp_path):
    repo, _ = _two_commits(offline_hub, tmp_path)
    with pytest.raises(ModelSourceError, match=f"could not fetch '{repo}' at revision 'v9'"):
        resolve_model(repo, revision="v9")
    local = _checkpoint(tmp_path / "local")
    with pytest.raises(ValueError, match="revision='v1' pins a Hugging Face repo id, but model=.* is a local"):
        resolve_model(local, revision="v1")
    with pytest.raises(ValueError, match="revision='v1' needs a repo id"):
        resolve_model(None, revision="v1")
    with pytest.raises(ValueError, match="revision must be a branch, tag or commit hash, got an empty string"):
        resolve_model(repo, revision="")
    with pytest.raises(TypeError, match=r"revision must be a branch, tag or commit hash \(a string\), got int"):
        resolve_model(repo, revision=3)


# --- the checkpoint's JSON files are checked before anything reads them -----------------------------------------


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("config.json", '{"model_type": "deepseek_v4"', "invalid JSON: Expecting ',' delimiter at line 1 column 29"),
        ("config.json", "[]", "expected a JSON object at the top level, found an array"),
        ("generation_config.json", "{'eos_token_id': 1}", "invalid JSON"),
        ("tokenizer_config.json", "null", "expected a JSON object at the top level, found null"),
        ("model.safetensors.index.json", "", "invalid JSON: Expecting value at line 1 column 1"),
        ("tokenizer.json", '{"model": ', "invalid JSON"),
        ("generation_config.json", '{"eos_token_id": "x"}', 'eos_token_id must be an integer >= 0, found "x"'),
        ("generation_config.json", '{"eos_token_id": [1, -1]}', "eos_token_id[1] must be an integer >= 0, found -1"),
    ],
    ids=["config", "config-array", "generation-config", "tokenizer-config", "index", "tokenizer", "eos-text",
         "eos-negative"],
)
def test_bad_json_files_are_named_at_resolution(tmp_path, offline_hub, name, text, message):
    from deepinfer.models import CheckpointError

    ckpt = _checkpoint(tmp_path / "ckpt")
    (ckpt / name).write_text(text)
    with pytest.raises(CheckpointError) as err:
        resolve_model(ckpt)
    assert str(err.value).startswith(f"{ckpt / name}: {message}"), str(err.value)
    # the same holds for a snapshot found in the HF cache
    from tests.support.hf_cache import add_snapshot, commit_hash

    add_snapshot(offline_hub, "some-org/broken", commit_hash("x"), ckpt, ("main",))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        resolve_model("some-org/broken")
