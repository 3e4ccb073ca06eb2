"""Packed KV rows: unpacking a packed row gives bit for bit the model's fake-quantized row (so storing V4.1's state
quantized changes no logit), and the byte counts are DeepSeek's (SWA 528 B, latent 288 B, indexer key 68 B per
token)."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.ops import OpTable
from deepinfer.ops.fake_quant import same_bits
from deepinfer.ops.registry import OpSample
from tests.support.v41_fixtures import FIXTURES

OPS = OpTable()
FORMATS = [("fp8", 32, "ue8m0", 528), ("fp4", 16, "e4m3", 288), ("fp4", 32, "ue8m0", 68)]


def _spread(rows: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-30, 20, (rows, width // 16, 1), generator=gen)).float()
    x = (torch.randn(rows, width // 16, 16, generator=gen) * spread).view(rows, width)
    x[0] = 0.0
    x[1, :8] = torch.tensor([0.25, -0.75, 1.25, 5.0, -0.0, 448.0, 1e-30, -6.0])
    return x


def _pack(kind, x, block, fmt):
    return OPS.fp8_e4m3_pack(x, block) if kind == "fp8" else OPS.fp4_e2m1_pack(x, block, fmt)


def _unpack(kind, packed, block, fmt, dtype):
    if kind == "fp8":
        return OPS.fp8_e4m3_unpack(packed, block, dtype)
    return OPS.fp4_e2m1_unpack(packed, block, fmt, dtype)


def _fake(kind, x, block, fmt):
    return OPS.fp8_e4m3_fake_quant(x, block) if kind == "fp8" else OPS.fp4_e2m1_fake_quant(x, block, fmt)


@pytest.mark.parametrize("kind, block, fmt, row_bytes", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpacked_rows_are_the_fake_quantized_rows(kind, block, fmt, row_bytes, dtype):
    width = {528: 512, 288: 512, 68: 128}[row_bytes]
    x = _spread(64, width, seed=row_bytes).to(dtype)
    packed = _pack(kind, x, block, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (64, row_bytes)
    fake = _fake(kind, x, block, fmt)
    sample = OpSample((), label=f"{kind} {block} {fmt}")
    same_bits(_unpack(kind, packed, block, fmt, dtype), fake, sample, dtype)
    if fmt == "ue8m0":  # re-packing fake-quantized rows keeps them; not with e4m3 scales (see ops.kv_quant)
        same_bits(_unpack(kind, _pack(kind, fake, block, fmt), block, fmt, dtype), fake, sample, dtype)


#: quant_vectors.json's case names -> (kind, block, scale format)
VECTOR_FORMATS = {"fp8_e4m3_ue8m0_block32": ("fp8", 32, "ue8m0"), "fp4_e2m1_e4m3scale_block16": ("fp4", 16, "e4m3"),
                  "fp4_e2m1_ue8m0_block32": ("fp4", 32, "ue8m0")}


@pytest.mark.parametrize("name", sorted(VECTOR_FORMATS))
def test_the_reference_quantizer_vectors_round_trip(name):
    """transformers' own fake-quantized outputs, bit for bit, through pack / unpack."""
    cases = json.loads((FIXTURES / "quantizers" / "quant_vectors.json").read_text())["cases"]
    case = next(c for n, c in cases.items() if n.split(" ")[0] == name)
    kind, block, fmt = VECTOR_FORMATS[name]
    x, expected = torch.tensor(case["input"]), torch.tensor(case["output"])
    out = _unpack(kind, _pack(kind, x, block, fmt), block, fmt, torch.float32)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


def test_a_width_off_the_block_is_refused():
    with pytest.raises(ValueError, match=r"last dim \(40\) to be a multiple of block \(32\)"):
        OPS.fp8_e4m3_pack(torch.randn(2, 40), 32)


def test_fp4_unpack_decodes_every_code():
    from deepinfer.quant.formats import E2M1_VALUES

    codes = torch.arange(16, dtype=torch.uint8)
    packed = torch.cat([codes[0::2] | (codes[1::2] << 4), torch.tensor([127], dtype=torch.uint8)])[None]  # scale 1
    got = OPS.fp4_e2m1_unpack(packed, 16, "ue8m0", torch.float32)[0]
    assert got.tolist() == list(E2M1_VALUES) and torch.equal(torch.signbit(got), torch.tensor(E2M1_VALUES).signbit())
