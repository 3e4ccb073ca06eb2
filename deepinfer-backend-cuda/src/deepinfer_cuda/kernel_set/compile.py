"""Ahead-of-time compilation of one kernel variant into a cubin and its manifest entry.

Runs anywhere Triton is installed: Triton's CUDA backend lowers to PTX and runs its bundled ``ptxas``
for an explicit target, so no GPU is needed.  The launch ABI is read off the PTX rather than assumed:
recent Triton versions append hidden parameters after the kernel's own (a global-scratch pointer, then
a profile-scratch pointer; 3.9's launcher passes both), and the entry records exactly what this Triton
emitted, so the launcher never guesses.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import TritonKernel
from deepinfer_cuda.kernel_set.manifest import HIDDEN_PARAMS_BY_COUNT, KernelEntry, Variant, sha256_bytes, variant_key
from deepinfer_cuda.kernel_set.specialize import ptx_param_types, tensordesc_rank

_PTX_ENTRY = re.compile(r"\.visible\s+\.entry\s+(\w+)\s*\(([^)]*)\)")
_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?(\.\w+)")  # a CUtensorMap: .align 64 .b8 [128]
_GRID_WAIT = "griddepcontrol.wait"  #: every Triton kernel of the set is launched as a programmatic dependent


class AotError(RuntimeError):
    """A variant cannot be shipped as a cubin (the launcher would not launch it correctly)."""


def ptx_entry_params(ptx: str) -> tuple[str, list[str]]:
    """(entry name, PTX types of its parameters in order) of the single kernel in ``ptx``."""
    match = _PTX_ENTRY.search(ptx)
    if match is None:
        raise AotError("no .visible .entry in the PTX")
    return match.group(1), _PTX_PARAM.findall(match.group(2))


def compile_variant(kernel: TritonKernel, arch: CudaArch, variant: Variant) -> tuple[KernelEntry, bytes]:
    """Compile ``variant`` of ``kernel`` for ``arch``; return its manifest entry and the cubin bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.jit_fn
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, p in enumerate(kernel.params):
        if p.name in variant.constexprs:
            signature[p.name] = "constexpr"
            continue
        if p.name not in variant.signature:
            raise AotError(f"{kernel.name}: variant gives neither a type nor a constexpr for {p.name!r}")
        ty, _, hint = variant.signature[p.name].partition(":")
        signature[p.name] = ty
        if hint == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs=dict(variant.constexprs), attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch.triton_arch, 32),
                              options={"num_warps": variant.num_warps, "num_stages": variant.num_stages,
                                       "launch_pdl": True})
    md = compiled.metadata
    where = f"{kernel.name} [{arch.name}] {variant.signature} {variant.constexprs}"
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise AotError(f"{where}: needs global/profile scratch memory, which the cubin launcher does not allocate")
    if md.num_ctas != 1 or getattr(md, "launch_cooperative_grid", False):
        raise AotError(f"{where}: clusters or cooperative launches are not supported by the cubin launcher")
    if _GRID_WAIT not in compiled.asm["ptx"]:  # launched with PDL, it would race the kernel before it
        raise AotError(f"{where}: the kernel does not begin with grid_dependency.wait_for_producers()")

    entry_name, ptx_params = ptx_entry_params(compiled.asm["ptx"])
    explicit = [p for t in variant.signature.values() for p in ptx_param_types(t)]
    descriptors = sum(tensordesc_rank(t.split(":")[0]) is not None for t in variant.signature.values())
    tensordesc_meta = list(getattr(md, "tensordesc_meta", None) or [])
    if len(tensordesc_meta) != descriptors or any(m.get("fp4_padded") for m in tensordesc_meta):
        raise AotError(f"{where}: {descriptors} TMA descriptors, {len(tensordesc_meta)} lowered to a CUtensorMap "
                       "(the cubin launcher encodes only those, and no padded fp4)")
    n_hidden = len(ptx_params) - len(explicit)
    if ptx_params[: len(explicit)] != explicit or n_hidden not in HIDDEN_PARAMS_BY_COUNT:
        raise AotError(f"{where}: PTX params {ptx_params} do not extend the signature {explicit} "
                       f"by a known set of hidden params (Triton {triton.__version__})")
    if any(t != ".u64" for t in ptx_params[len(explicit):]):
        raise AotError(f"{where}: hidden params {ptx_params[len(explicit):]} are not pointers")
    if entry_name != md.name:
        raise AotError(f"{where}: PTX entry {entry_name!r} differs from Triton's name {md.name!r}")

    cubin: bytes = compiled.asm["cubin"]
    key = variant_key(kernel.name, arch.name, variant.signature, variant.constexprs,
                      variant.num_warps, variant.num_stages)
    entry = KernelEntry(
        kernel=kernel.name,
        arch=arch.name,
        key=key,
        entry=entry_name,
        cubin=str(Path(arch.name) / f"{kernel.name}-{sha256_bytes(key.encode())[:16]}.cubin"),
        sha256=sha256_bytes(cubin),
        signature=[[name, ty] for name, ty in variant.signature.items()],
        constexprs=dict(variant.constexprs),
        num_warps=md.num_warps,
        num_stages=md.num_stages,
        num_ctas=md.num_ctas,
        shared=md.shared,
        ptx_params=ptx_params,
        hidden_params=list(HIDDEN_PARAMS_BY_COUNT[n_hidden]),
        launch_cooperative_grid=bool(getattr(md, "launch_cooperative_grid", False)),
        launch_pdl=bool(getattr(md, "launch_pdl", False)),
        tensordesc_meta=tensordesc_meta,
    )
    return entry, cubin
