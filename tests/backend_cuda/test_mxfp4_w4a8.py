"""The W4A8 MXFP4 experts (opt-in ``DEEPINFER_MXFP4_ACTIVATIONS=fp8``) without a GPU: the e2m1 -> e4m3 decode's bit
steps for every code, the K order's contract with the FP8 wgmma fragment, the activation quantizer under Triton's
interpreter against its torch oracle, and the op's plan.  The GPU side is ``test_mxfp4_w4a8_gpu.py``."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.quant.formats import E2M1_VALUES  # noqa: E402
from deepinfer_cuda.arch import SM90A, SM100A, Mxfp4TileLang, mxfp4_w4a8_config  # noqa: E402
from deepinfer_cuda.kernel_set.dispatch import use_kernel_set  # noqa: E402
from deepinfer_cuda.kernel_set.manifest import Manifest, kernel_sources_digest  # noqa: E402
from deepinfer_cuda.kernels import fp8_e4m3_rows  # noqa: E402
from deepinfer_cuda.kernels import moe_experts_mxfp4_w4a8_tl as w4a8  # noqa: E402
from tests.backend_cuda.test_tilelang_kernel_set import _entry, _layer  # noqa: E402
from tests.support.interpreter import run_interpreted  # noqa: E402


def _e4m3(byte: int) -> float:
    return torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()


def test_the_decode_makes_each_code_its_e4m3_value_times_two_to_the_minus_6():
    """``_DECODE``'s two registers, emulated with its constants, for words holding every code at every nibble:
    byte i of the even register is code 2i, of the odd one code 2i + 1, each exactly its value times 2^-6 (signed
    zero included)."""
    gen = torch.Generator().manual_seed(0)
    for word in [0x76543210, 0xFEDCBA98, 0x89ABCDEF, *torch.randint(0, 2 ** 32, (32,), generator=gen).tolist()]:
        even = ((word << 2) & w4a8.MAGNITUDE) | ((word << 4) & w4a8.SIGN)
        odd = ((word >> 2) & w4a8.MAGNITUDE) | (word & w4a8.SIGN)
        for i in range(4):
            for register, nibble in ((even, 2 * i), (odd, 2 * i + 1)):
                value = _e4m3((register >> 8 * i) & 0xFF)
                expected = E2M1_VALUES[(word >> 4 * nibble) & 15] * 2.0 ** -w4a8.CODE_EXPONENT
                assert value == expected and math.copysign(1, value) == math.copysign(1, expected), (word, nibble)


def test_the_k_order_gives_each_fragment_lane_one_word_of_its_group():
    """A k32 e4m3 A fragment gives lane q columns 4q..4q + 3 (one register) and 16 + 4q..16 + 4q + 3 (another) of
    each 32-column group; the K order maps them to stored columns 8q..8q + 7 (one word), the first register to its
    even codes; groups map onto themselves and the up GEMM's output positions invert the order."""
    n = 128
    order = w4a8.k_order(n, torch.device("cpu")).long()
    columns = torch.arange(n)
    assert torch.equal(order.sort().values, columns) and torch.equal(w4a8.k_position(order), columns)
    assert torch.equal(order // 32, columns // 32)
    for group in range(n // 32):
        for q in range(4):
            first = order[[32 * group + 4 * q + i for i in range(4)]]
            second = order[[32 * group + 16 + 4 * q + i for i in range(4)]]
            assert first.tolist() == [32 * group + 8 * q + 2 * i for i in range(4)]  # the word's even codes
            assert torch.equal(second, first + 1)  # its odd codes


def test_the_tiers_stop_before_prefill_and_hopper_only():
    assert mxfp4_w4a8_config(SM90A, 6, 384) == Mxfp4TileLang(16, 256, 4, 2)  # the sweep's b1 winner
    assert mxfp4_w4a8_config(SM90A, 64 * 6, 384) is not None
    assert mxfp4_w4a8_config(SM90A, 2048 * 6, 384) is None  # a prefill runs the exact forms
    assert mxfp4_w4a8_config(SM100A, 6, 384) is None


def test_the_op_plans_w4a8_when_asked_and_the_set_has_it(tmp_path, monkeypatch):
    """``DEEPINFER_MXFP4_ACTIVATIONS=fp8`` plans plan -> quantize x -> up -> quantize act -> down -> combine where the
    set has the variant; without it (or without the variable) the op plans its exact forms."""
    from deepinfer_cuda.kernels import moe_experts_mxfp4
    from deepinfer_cuda.ops import tilelang_kernels

    layer = _layer()
    config = mxfp4_w4a8_config(SM90A, 6, 8)
    variant = w4a8._variant(config, 256, 128)
    try:
        use_kernel_set(None)
        assert w4a8.prepare(*layer, arch=SM90A) is None  # no set
        entries = [_entry(k.name, variant) for k in tilelang_kernels()]
        Manifest(triton_version=__import__("triton").__version__, archs=["sm_90a"], kernels=entries,
                 kernel_sources=kernel_sources_digest()).write(tmp_path)
        use_kernel_set(tmp_path)
        chain = w4a8.prepare(*layer, arch=SM90A)
        assert chain is not None
        names = [k.name for k, _ in chain.steps]
        assert names[-5:] == ["fp8_e4m3_rows", "moe_experts_mxfp4_w4a8_up", "fp8_e4m3_rows",
                              "moe_experts_mxfp4_w4a8_down", "moe_experts_combine"]
        quant_x, up, quant_act, down = (launch for _, launch in chain.steps[-5:-1])
        assert quant_x.args["order_ptr"] is up.args["order"] and quant_x.args["GATHER"]
        assert up.args["xs"] is quant_x.args["out_ptr"] and up.args["xscale"] is quant_x.args["scale_ptr"]
        assert quant_act.args["x_ptr"] is up.args["out"] and not quant_act.args["GATHER"]
        assert down.args["xs"].dtype == torch.float8_e4m3fn and down.args["xscale"] is quant_act.args["scale_ptr"]
        assert up.args["constexprs"] == variant and up.grid == (up.args["nb"], 2)
        assert w4a8.prepare(*(layer[0].float(), *layer[1:]), arch=SM90A) is None  # bf16 x only
        monkeypatch.setattr(moe_experts_mxfp4, "cuda_target", lambda x: (0, SM90A))
        seen = []
        monkeypatch.setattr("deepinfer_cuda.kernel_set.dispatch.LaunchChain.run",
                            lambda self, index: seen.append([k.name for k, _ in self.steps]))
        monkeypatch.delenv("DEEPINFER_MXFP4_ACTIVATIONS", raising=False)
        moe_experts_mxfp4.moe_experts_mxfp4(*layer)
        monkeypatch.setenv("DEEPINFER_MXFP4_ACTIVATIONS", "fp8")
        moe_experts_mxfp4.moe_experts_mxfp4(*layer)
        assert "moe_experts_mxfp4_w4a8_up" not in seen[0] and "moe_experts_mxfp4_w4a8_up" in seen[1]
    finally:
        use_kernel_set(None)


def test_every_flash_quantizer_launch_has_an_aot_variant():
    variants = {(v.constexprs["N"], v.constexprs["GATHER"]) for v in fp8_e4m3_rows._variants(SM90A)}
    assert {(5120, True), (2304, False), (4096, True), (2048, False)} <= variants
    x = torch.zeros(2, 5120, dtype=torch.bfloat16)
    order = torch.zeros(12, dtype=torch.int32)
    launch, codes, scales = fp8_e4m3_rows.plan(x, 12, order, w4a8.k_order(5120, x.device), 6)
    assert fp8_e4m3_rows.KERNEL.has_aot_variant(launch, SM90A) and codes.shape == (12, 5120)
    act = torch.zeros(12, 2304, dtype=torch.bfloat16)
    assert fp8_e4m3_rows.KERNEL.has_aot_variant(fp8_e4m3_rows.plan(act, 12, None, None, 6)[0], SM90A)


QUANTIZER = textwrap.dedent(
    """
    import torch
    from deepinfer_cuda.kernels import fp8_e4m3_rows as q
    from deepinfer_cuda.kernels import moe_experts_mxfp4_w4a8_tl as w4a8

    q.INTERPRETED = True
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 320, generator=gen) * torch.logspace(-30, 3, 5)[:, None]).bfloat16()
    x[2] = 0  # a zero row: scale 2^-126, codes 0
    x[3, 7] = 3e38  # a row whose largest value is near fp32's top
    order = torch.tensor([7, 0, 13, 4, 9, 2, 14], dtype=torch.int32)  # top-3 slots: token = slot // 3
    cols = w4a8.k_order(320, x.device)
    for rows, o, c, source in ((7, order, cols, x[order.long() // 3][:, cols.long()]), (5, None, None, x)):
        launch, codes, scales = q.plan(x, rows, o, c, 3)
        q.KERNEL.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps)
        want_codes, want_scales = q.reference(source)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), (codes, want_codes)
        assert torch.equal(scales, want_scales), (scales, want_scales)
        back = codes.float() * scales[:, None]
        normal = source.float().abs() >= scales[:, None] * 2.0 ** -6  # e4m3's normal range
        rel = ((back - source.float()).abs() / source.float().abs())[normal]
        assert rel.max() <= 2.0 ** -4, rel.max()  # 3 mantissa bits, rounded to nearest
    print("OK")
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: test_mxfp4_w4a8_gpu.py runs the cubins")
def test_the_quantizer_under_the_interpreter_matches_its_torch_oracle():
    assert run_interpreted(QUANTIZER, timeout=300).split() == ["OK"]
