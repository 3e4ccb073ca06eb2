"""Triton's argument specialization, mirrored so a launch can find its cubin without Triton's binder.

Triton compiles one variant per *specialization* of the non-constexpr arguments: the type (pointer
element type, i32 / i64 / u64 by value range, fp32 for floats, u1 for bools), whether a pointer or an
integer is divisible by 16 (``:D``, which lets the compiler emit 16-byte accesses), and integers equal
to 1 turned into constexprs; a host-side TMA descriptor (``TensorDescriptor``) by its element type and block
shape (``tensordesc<bf16[32, 256]>``).  A cubin built for one specialization is only valid for arguments with
the same one, so the runtime computes it from the live arguments exactly as Triton's JIT would
(``tests/backend_cuda`` checks this mirror against Triton's own ``native_specialize_impl``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

#: torch dtype -> Triton's element type name.
TRITON_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.uint16: "u16",
    torch.uint32: "u32",
    torch.uint64: "u64",
    torch.bool: "u1",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}

#: PTX parameter types (as Triton emits them) for each Triton scalar / pointer type.
PTX_PARAM_TYPES: dict[str, str] = {
    "ptr": ".u64",
    "i1": ".u8", "u1": ".u8", "i8": ".u8", "u8": ".u8",
    "i16": ".u16", "u16": ".u16",
    "i32": ".u32", "u32": ".u32",
    "i64": ".u64", "u64": ".u64",
    "fp32": ".f32", "fp64": ".f64",
}


@dataclass(slots=True, frozen=True)
class ParamInfo:
    """What Triton's JIT needs to know about one parameter to specialize it."""

    name: str
    is_constexpr: bool
    specialize: bool = True  #: False for ``do_not_specialize`` params
    align: bool = True  #: False for ``do_not_specialize_on_alignment`` params


def params_of(jit_fn: Any) -> list[ParamInfo]:
    """Read the parameter list (with do_not_specialize flags) off a ``triton.JITFunction``."""
    params = getattr(jit_fn, "params", None)
    if params is None:  # Triton's interpreter (TRITON_INTERPRET=1) keeps only the Python function
        sig = inspect.signature(jit_fn.fn)
        return [ParamInfo(n, "constexpr" in str(p.annotation)) for n, p in sig.parameters.items()]
    return [ParamInfo(p.name, bool(p.is_constexpr), not p.do_not_specialize, not p.do_not_specialize_on_alignment)
            for p in params]


def specialize_arg(value: Any, specialize: bool = True, align: bool = True) -> tuple[str, Any]:
    """``(type, hint)`` for one argument, as Triton 3.4-3.9's ``specialize_impl`` computes it.

    Returns ``("constexpr", value)`` where Triton folds the argument into the kernel (None, and an
    integer equal to 1 when specialization is on); else the type and ``"D"`` / ``""`` for divisibility
    (``None`` when the type carries no hint: floats, bools, unspecialized ints).
    """
    if value is None:
        return "constexpr", None
    if isinstance(value, bool):
        return "u1", None
    if isinstance(value, int):
        if specialize and value == 1:
            return "constexpr", 1
        if -(2**31) <= value < 2**31:
            ty = "i32"
        elif 2**63 <= value < 2**64:
            ty = "u64"
        elif -(2**63) <= value < 2**63:
            ty = "i64"
        else:
            raise OverflowError(f"integer argument {value} does not fit a kernel parameter")
        if not specialize:
            return ty, None
        return ty, "D" if align and value % 16 == 0 else ""
    if isinstance(value, float):
        return "fp32", None
    if isinstance(value, TensorDescriptor):
        return tensordesc_type(value), None
    if isinstance(value, torch.Tensor):
        try:
            elem = TRITON_DTYPES[value.dtype]
        except KeyError:
            raise TypeError(f"no Triton element type for {value.dtype}") from None
        if not specialize:
            return "*" + elem, None
        return "*" + elem, "D" if align and value.data_ptr() % 16 == 0 else ""
    raise TypeError(f"cannot pass {type(value).__name__} to a Triton kernel")


def signature_of(params: list[ParamInfo], args: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """Split live arguments into the specialized signature and the constexprs Triton would fold.

    ``args`` holds every parameter by name.  The signature maps each remaining runtime parameter to
    ``type`` or ``type:D``; constexprs include declared constexprs and folded ones (None, int 1).
    """
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for p in params:
        value = args[p.name]
        if p.is_constexpr:
            constexprs[p.name] = value
            continue
        ty, hint = specialize_arg(value, p.specialize, p.align)
        if ty == "constexpr":
            constexprs[p.name] = hint
        else:
            signature[p.name] = f"{ty}:D" if hint == "D" else ty
    return signature, constexprs


def tensordesc_type(desc: TensorDescriptor) -> str:
    """Triton's type of a host-side TMA descriptor: its element type and block shape."""
    return f"tensordesc<{TRITON_DTYPES[desc.base.dtype]}[{', '.join(str(int(b)) for b in desc.block_shape)}]>"


def tensordesc_rank(sig_type: str) -> int | None:
    """The rank of a ``tensordesc<...>`` signature type (None for any other type)."""
    if not sig_type.startswith("tensordesc<"):
        return None
    return sig_type[sig_type.index("[") : sig_type.index("]")].count(",") + 1


def ptx_param_types(sig_type: str) -> list[str]:
    """The PTX ``.param`` types a signature entry lowers to (``*bf16:D`` -> ``.u64``).  A TMA descriptor is the
    128-byte ``CUtensorMap`` (``.b8``), then its shape (``.u32`` each) and strides (``.u64`` each)."""
    ty = sig_type.split(":")[0]
    rank = tensordesc_rank(ty)
    if rank is not None:
        return [".b8"] + [".u32"] * rank + [".u64"] * rank
    return [PTX_PARAM_TYPES["ptr" if ty.startswith("*") else ty]]
