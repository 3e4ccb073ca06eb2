"""Checkpoints are validated when they load, not at the first step: dtypes and names from the headers, values
(finite; routing ids in range) as tensors arrive, the files themselves (readable safetensors, regular files,
shard names inside the checkpoint).  Every error is one line naming the file, the tensor, what was expected
and what was found."""

from __future__ import annotations

import json
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.models import CheckpointError, load_model
from deepinfer.models.checkpoint import SafetensorsCheckpoint
from deepinfer.ops import OpTable
from tests.support.hf_cache import add_snapshot, commit_hash
from tests.support.model_runs import run_chunked
from tests.support.v4_fixtures import (  # noqa: F401  (single_thread is an autouse fixture)
    SMALL,
    build_checkpoint,
    random_tokens,
    read_tensors,
    single_thread,
    write_checkpoint,
)

EXPERTS = SMALL["n_routed_experts"]
WKV = "model.layers.0.attn.wkv.weight"
TID2EID = "model.layers.0.ffn.gate.tid2eid"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path, _ = build_checkpoint(tmp_path_factory.mktemp("v4"), SMALL, seed=5)
    return path, read_tensors(path), json.loads((path / "config.json").read_text())


def _load(path, dtype=torch.float32):
    return load_model(path, ops=OpTable(), dtype=dtype, device=torch.device("cpu"))


def _refused(path, *fragments, dtype=torch.float32) -> str:
    """Loading ``path`` raises a one-line CheckpointError holding every fragment; returns the message."""
    with pytest.raises(CheckpointError) as err:
        _load(path, dtype)
    message = str(err.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def _sharded(directory: Path, tensors: dict[str, torch.Tensor], config: dict, parts: int = 2) -> list[str]:
    """``tensors`` in ``parts`` shard files with an index; returns the shard file names."""
    directory.mkdir(parents=True, exist_ok=True)
    names, weight_map, files = sorted(tensors), {}, []
    for k in range(parts):
        file = f"model-{k + 1:05d}-of-{parts:05d}.safetensors"
        part = names[k::parts]
        save_file({n: tensors[n].contiguous() for n in part}, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
        files.append(file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    return files


def _with_index(directory: Path, weight_map: dict[str, str]) -> Path:
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


# --- dtypes, from the headers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit, fragments",
    [
        ({WKV: lambda w: w.to(torch.int32)},
         ["model.safetensors: layers.0.attn.wkv.weight: expected dtype F32/BF16/F16/F64 (a floating-point tensor), "
          "found I32"]),
        ({"model.layers.1.attn_norm.weight": lambda w: w > 0},
         ["layers.1.attn_norm.weight: expected dtype F32/BF16/F16/F64", "found BOOL"]),
        ({WKV: lambda w: w.to(torch.float8_e4m3fn)}, ["layers.0.attn.wkv.weight", "found F8_E4M3 without a .scale"]),
        ({TID2EID: lambda t: t.float()},
         ["layers.0.ffn.gate.tid2eid: expected dtype I64/I32/I16/I8/U64/U32/U16/U8 (expert ids), found F32"]),
        ({WKV: lambda w: w.to(torch.int32), "model.layers.2.ffn.experts.3.w2.weight": lambda w: w.to(torch.int8)},
         ["(2 problems)", "layers.0.attn.wkv.weight", "layers.2.ffn.experts.3.w2.weight", "found I8"]),
    ],
    ids=["int32-weight", "bool-norm", "fp8-without-scale", "float-routing-table", "two-at-once"],
)
def test_stored_dtypes_are_checked_before_any_data_is_read(saved, tmp_path, monkeypatch, edit, fragments):
    _, tensors, config = saved
    tensors = {**tensors, **{name: change(tensors[name]) for name, change in edit.items()}}
    path = write_checkpoint(tmp_path / "bad", tensors, config)
    monkeypatch.setattr(SafetensorsCheckpoint, "get", lambda *a: pytest.fail("tensor data read before the check"))
    _refused(path, *fragments)


def test_quantized_scales_and_mtp_tensors_are_typed_too(saved, tmp_path):
    _, tensors, config = saved
    fp8 = {"model.layers.0.attn.wq_a.weight": torch.zeros(32, 64).to(torch.float8_e4m3fn),
           "model.layers.0.attn.wq_a.scale": torch.ones(1, 1, dtype=torch.int32)}
    _refused(write_checkpoint(tmp_path / "scale", {**tensors, **fp8}, config),
             "layers.0.attn.wq_a.scale: expected dtype F32/BF16/F16/F8_E8M0/U8 (fp8_block scales), found I32")
    mtp = {"mtp.0.e_proj.weight": torch.ones(64, 64, dtype=torch.int32)}
    _refused(write_checkpoint(tmp_path / "mtp", {**tensors, **mtp}, config),
             "mtp.0.e_proj.weight: expected dtype F32/BF16/F16/F64 (a floating-point tensor), found I32")


# --- values, as tensors arrive ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "table, fragments",
    [
        (lambda t: t.masked_fill(t == 0, EXPERTS),
         [f"expected ids in [0, {EXPERTS}) (n_routed_experts = {EXPERTS}), found values from 1 to {EXPERTS} "]),
        (lambda t: torch.cat([t[:-1], torch.full_like(t[-1:], -1)]), ["found values from -1 to", "out of range"]),
        (lambda t: t.to(torch.int32) + 1000, ["found values from 1000 to"]),
    ],
    ids=["past-the-last-expert", "negative", "int32-far-out"],
)
def test_routing_table_ids_are_checked(saved, tmp_path, table, fragments):
    _, tensors, config = saved
    path = write_checkpoint(tmp_path / "bad", {**tensors, TID2EID: table(tensors[TID2EID])}, config)
    message = _refused(path, *fragments)
    assert f"{path / 'model.safetensors'}: layers.0.ffn.gate.tid2eid (stored as '{TID2EID}')" in message


def _poison(value: float, at: tuple[int, ...] = (3, 5)):
    def change(w: torch.Tensor) -> torch.Tensor:
        w = w.clone()
        w[at] = value
        return w
    return change


@pytest.mark.parametrize(
    "name, change, dtype, fragments",
    [
        (WKV, _poison(float("nan")), torch.float32, ["found 1 of 2048 non-finite (1 NaN, 0 inf)"]),
        ("model.layers.2.ffn_norm.weight", _poison(float("inf"), (7,)), torch.bfloat16,
         ["layers.2.ffn_norm.weight", "(0 NaN, 1 inf)"]),
        ("model.layers.3.ffn.experts.5.w1.weight", _poison(-float("inf")), torch.bfloat16,
         ["layers.3.ffn.experts.5.w1.weight", "1 inf"]),
        (WKV, _poison(1e6), torch.float16,
         ["layers.0.attn.wkv.weight", "after conversion from float32 to float16 (values out of its range)"]),
    ],
    ids=["nan-projection", "inf-fp32-norm", "inf-expert", "fp16-overflow"],
)
def test_non_finite_weights_are_refused(saved, tmp_path, name, change, dtype, fragments):
    _, tensors, config = saved
    path = write_checkpoint(tmp_path / "bad", {**tensors, name: change(tensors[name])}, config)
    _refused(path, str(path / "model.safetensors"), "expected finite values", *fragments, dtype=dtype)


@pytest.mark.parametrize(
    "scale, found",
    [(torch.tensor([[float("nan")]]), "1 NaN"), (torch.tensor([[255]], dtype=torch.uint8), "1 NaN"),
     (torch.tensor([[float("inf")]]), "1 inf")],
    ids=["fp32-nan", "e8m0-byte-nan", "fp32-inf"],
)
def test_non_finite_quantization_scales_are_refused(saved, tmp_path, scale, found):
    _, tensors, config = saved
    fp8 = {"model.layers.0.attn.wq_a.weight": torch.zeros(32, 64).to(torch.float8_e4m3fn),
           "model.layers.0.attn.wq_a.scale": scale}
    _refused(write_checkpoint(tmp_path / "bad", {**tensors, **fp8}, config),
             "layers.0.attn.wq_a.scale (stored as 'model.layers.0.attn.wq_a.scale'): expected finite values", found)


# --- the files ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_safetensors_parse_errors_name_the_file(saved, tmp_path, damage):
    _, tensors, config = saved
    files = _sharded(tmp_path / "ckpt", tensors, config)
    shard = tmp_path / "ckpt" / files[1]
    data = shard.read_bytes()
    shard.write_bytes({"garbage": b"not a safetensors file at all", "truncated": data[: len(data) // 2],
                       "empty": b""}[damage])
    _refused(tmp_path / "ckpt", f"{shard}: not a readable safetensors file")


@contextmanager
def _fifo_unblocked_after(fifo: Path | None, seconds: float):
    """A separate process opens ``fifo`` for writing after ``seconds`` (and closes it), so a reader blocked on it
    wakes up and the test fails instead of hanging (a reader blocked inside a C extension may hold the GIL, so a
    thread of this process could not help)."""
    if fifo is None:
        yield
        return
    writer = subprocess.Popen(["sh", "-c", 'sleep "$1"; : > "$0"', str(fifo), str(seconds)])
    try:
        yield
    finally:
        writer.kill()
        writer.wait()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("layout", ["single-fifo", "shard-fifo", "shard-directory", "index-fifo"])
def test_a_non_regular_file_in_place_of_a_shard_fails_at_once(saved, tmp_path, layout):
    _, tensors, config = saved
    ckpt = tmp_path / "ckpt"
    if layout == "single-fifo":
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps(config))
        os.mkfifo(ckpt / "model.safetensors")
        target, kind = ckpt / "model.safetensors", "a FIFO"
    else:
        files = _sharded(ckpt, tensors, config)
        target = ckpt / ("model.safetensors.index.json" if layout == "index-fifo" else files[0])
        target.unlink()
        target.mkdir() if layout == "shard-directory" else os.mkfifo(target)
        kind = "a directory" if layout == "shard-directory" else "a FIFO"
    start = time.monotonic()
    with _fifo_unblocked_after(target if kind == "a FIFO" else None, 20), pytest.raises(CheckpointError) as err:
        _load(ckpt)
    assert time.monotonic() - start < 20, "blocked on the FIFO until its writer came"
    assert str(err.value) == f"{target}: expected a regular file, found {kind}"


@pytest.mark.parametrize(
    "shard_name, problem",
    [("../elsewhere.safetensors", "leaves the checkpoint directory (..)"),
     ("sub/../../elsewhere.safetensors", "leaves the checkpoint directory (..)"),
     ("ABSOLUTE", "is an absolute path"), (7, "is not a file name")],
    ids=["dotdot", "nested-dotdot", "absolute", "not-a-string"],
)
def test_index_shard_names_stay_inside_the_checkpoint(saved, tmp_path, shard_name, problem):
    """The outside file is a valid shard holding every tensor: only the name is wrong."""
    _, tensors, config = saved
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "elsewhere.safetensors"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config))
    name = str(tmp_path / "elsewhere.safetensors") if shard_name == "ABSOLUTE" else shard_name
    _with_index(ckpt, dict.fromkeys(tensors, name))
    _refused(ckpt, f"{ckpt / 'model.safetensors.index.json'}: weight_map[", f"{name!r} {problem}")


@pytest.mark.parametrize(
    "index, fragment",
    [("{not json", "invalid JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
     ("[]", "expected a JSON object at the top level, found an array"),
     ('{"metadata": {}}', 'expected a non-empty "weight_map" object')],
    ids=["invalid-json", "array", "no-weight-map"],
)
def test_a_bad_index_is_named(saved, tmp_path, index, fragment):
    _, tensors, config = saved
    _sharded(tmp_path / "ckpt", tensors, config)
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(index)
    _refused(tmp_path / "ckpt", f"{tmp_path / 'ckpt' / 'model.safetensors.index.json'}: {fragment}")


def test_index_and_shards_must_agree(saved, tmp_path):
    _, tensors, config = saved
    files = _sharded(tmp_path / "ckpt", tensors, config)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    moved = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][moved] = files[1]  # listed in the shard that does not hold it
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(tmp_path / "ckpt", f"lists tensors that {files[1]} does not hold: ['{moved}']")
    (tmp_path / "ckpt" / files[1]).unlink()
    _refused(tmp_path / "ckpt", f"{tmp_path / 'ckpt' / files[1]}: does not exist")


def test_hf_snapshot_symlinks_into_the_blob_store_load(saved, tmp_path):
    """HF snapshots are symlinks ``snapshots/<commit>/<file> -> ../../blobs/<sha256>``, outside the snapshot
    directory: shard names are checked, not where they resolve, so these load (single file and sharded)."""
    path, tensors, config = saved
    tokens = random_tokens(24, SMALL["vocab_size"], seed=3)
    expected = run_chunked(_load(path), tokens, 24)
    _sharded(tmp_path / "sharded", tensors, config)
    for label, source in (("single", path), ("sharded", tmp_path / "sharded")):
        snapshot = add_snapshot(tmp_path / "hub", "org/tiny", commit_hash(label), source)
        assert (snapshot / "config.json").is_symlink()
        assert not (snapshot / "config.json").resolve().is_relative_to(snapshot)
        torch.testing.assert_close(run_chunked(_load(snapshot), tokens, 24), expected)
    broken = snapshot / "model-00001-of-00002.safetensors"
    broken.resolve().unlink()
    _refused(snapshot, f"{broken}: does not exist (a broken symlink)")
