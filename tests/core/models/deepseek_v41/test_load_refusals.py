"""The V4.1 loader fails closed, from the headers, before any tensor data is read, with every problem in one
error: an unexpected name (``mtp.*`` included, with speculative decoding off too), an orphan ``.scale``, a
``.scale`` beside a float weight, and each role's layout (dense FP8: e4m3 with ue8m0 scales on the block grid;
MXFP4 routed experts: [rows, K/2] bytes with [rows, K/32] scales; Engram tables: [rows, D] FP8 with [rows, D/32]
scales), each message naming the tensor, what it has and what its role needs.  It ignores the vision tower
(``vision.*``, ``aligner.*``, ``image_*``) and ``ffn.gate.bias_vl``, and takes both spellings of the DSpark
confidence head."""

from __future__ import annotations

import pytest
import torch

from deepinfer.models import load_model
from deepinfer.models.checkpoint import CheckpointError, SafetensorsCheckpoint
from deepinfer.ops import OpTable
from deepinfer.testing.released_checkpoint import TINY_TEXT_CONFIG
from tests.support.model_runs import run_chunked
from tests.support.quantized import released_tiny_v41, rewrite_checkpoint
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return released_tiny_v41(tmp_path_factory.mktemp("tiny_v41_released"))[0]


def _load(path):
    return load_model(path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))


def _refused(path, monkeypatch, *fragments) -> str:
    """Loading ``path`` raises one CheckpointError holding every fragment, having read no tensor's data."""

    def unread(self, name):
        raise AssertionError(f"tensor data read before the checks: {name}")

    monkeypatch.setattr(SafetensorsCheckpoint, "get", unread)
    with pytest.raises(CheckpointError) as err:
        _load(path)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def _e8m0(shape, code=127):
    return torch.full(shape, code, dtype=torch.uint8).view(torch.float8_e8m0fnu)


CASES = {
    "unexpected name": (
        lambda t: t.update({"layers.0.attn.bogus.weight": torch.zeros(3)}),
        ["layers.0.attn.bogus.weight: unexpected tensor of shape (3,)"]),
    "unexpected mtp name": (
        lambda t: t.update({"mtp.0.attn.bogus.weight": torch.zeros(3)}),
        ["mtp.0.attn.bogus.weight: unexpected tensor of shape (3,)"]),
    "missing mtp tensor": (
        lambda t: t.pop("mtp.1.markov_head.head.weight"),
        [f"mtp.1.markov_head.head.weight: missing (expected shape ({TINY_TEXT_CONFIG['vocab_size']}, 32))"]),
    "orphan scale": (
        lambda t: t.update({"layers.0.attn.bogus.scale": _e8m0((2, 2))}),
        ["layers.0.attn.bogus.scale: a .scale with no weight 'layers.0.attn.bogus.weight' of this model"]),
    "scale beside a float weight": (
        lambda t: t.update({"layers.0.attn.q_norm.scale": _e8m0((2, 2))}),
        ["layers.0.attn.q_norm.weight: has a .scale beside it but dtype BF16: a scale belongs to FP8 e4m3"]),
    "dense FP8 grid": (
        lambda t: t.update({"layers.0.attn.wq_a.scale": _e8m0((3, 4))}),
        ["layers.0.attn.wq_a.weight: FP8 dense projection of dense shape (64, 128) stored as data (64, 128) with "
         "scales (3, 4); the role needs data (64, 128) and scales (2, 4) (32x32 blocks) or (1, 1) (128x128 blocks)"]),
    "dense FP8 scale dtype": (
        lambda t: t.update({"layers.0.attn.wq_a.scale": torch.ones(2, 4)}),
        ["layers.0.attn.wq_a.scale: expected dtype F8_E8M0/U8 (fp8_block scales), found F32"]),
    "MXFP4 scales per 16": (
        lambda t: t.update({"layers.2.ffn.experts.1.w2.scale": _e8m0((128, 6))}),
        ["layers.2.ffn.experts.1.w2.weight: MXFP4 routed expert of dense shape (128, 96) stored as data (128, 48) "
         "with scales (128, 6); the role needs data (128, 48) (two e2m1 a byte) and scales (128, 3)"]),
    "MXFP4 outside the experts": (
        lambda t: t.update({"layers.0.attn.wkv.weight": torch.zeros(64, 64, dtype=torch.int8),
                            "layers.0.attn.wkv.scale": _e8m0((64, 4))}),
        ["layers.0.attn.wkv.weight: packed FP4 (MXFP4) data (64, 64) with scales (64, 4): the dense projection role "
         "is read as FP8 or float"]),
    "Engram grid": (
        lambda t: t.update({"layers.1.engram.embed.scale": _e8m0((4062, 2))}),
        ["layers.1.engram.embed.weight: FP8 Engram table of dense shape (4062, 32) stored as data (4062, 32) with "
         "scales (4062, 2); the role needs data (4062, 32) and scales (4062, 1) (1x32 blocks)"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_by_name_before_reading(released, tmp_path, monkeypatch, case):
    change, fragments = CASES[case]
    _refused(rewrite_checkpoint(released, tmp_path / "bad", change), monkeypatch, *fragments)


def test_every_problem_is_listed_at_once_and_mtp_names_are_checked_with_the_drafter_off(released, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")

    def change(t):
        for case in ("unexpected mtp name", "orphan scale", "Engram grid"):
            CASES[case][0](t)

    path = rewrite_checkpoint(released, tmp_path / "bad", change)
    message = _refused(path, monkeypatch, "(3 problems)",
                       *(fragment for case in ("unexpected mtp name", "orphan scale", "Engram grid")
                         for fragment in CASES[case][1]))
    from deepinfer import LLM

    monkeypatch.undo()  # (reads allowed again) the same through LLM with speculative decoding off
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    with pytest.raises(CheckpointError, match="mtp.0.attn.bogus.weight: unexpected"):
        LLM(str(path), dtype="float32")
    assert "does not match its config" in message


def test_vision_parts_are_ignored_and_both_confidence_head_spellings_load(released, tmp_path):
    def change(t):
        t.update({"vision.blocks.0.attn.qkv.weight": torch.zeros(4, 4), "aligner.proj.weight": torch.zeros(2),
                  "image_newline": torch.zeros(128), "image_start_embed": torch.zeros(128),
                  "layers.0.ffn.gate.bias_vl": torch.zeros(4), "mtp.0.ffn.gate.bias_vl": torch.zeros(4)})
        t["mtp.1.confidence_head.weight"] = t.pop("mtp.1.confidence_head.proj.weight")

    path = rewrite_checkpoint(released, tmp_path / "extras", change)
    model, original = _load(path), _load(released)
    tokens = torch.arange(3, 40)
    assert torch.equal(run_chunked(model, tokens, 37), run_chunked(original, tokens, 37))
    assert torch.equal(model.dspark.confidence.weight, original.dspark.confidence.weight)

    def both(t):
        t["mtp.1.confidence_head.weight"] = t["mtp.1.confidence_head.proj.weight"].clone()

    with pytest.raises(CheckpointError, match="mtp.1.confidence_head.proj.weight: stored twice"):
        _load(rewrite_checkpoint(released, tmp_path / "both", both))
