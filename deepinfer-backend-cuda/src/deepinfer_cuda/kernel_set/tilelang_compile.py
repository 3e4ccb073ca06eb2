"""Ahead-of-time compilation of one TileLang kernel variant into a cubin and its manifest entry (an optional step).

TileLang lowers the program on any machine (no GPU): its device module becomes CUDA C++, which ``nvcc -cubin``
compiles for the arch (``-gencode arch=compute_90a,code=sm_90a``, TileLang's templates and CUTLASS on the include
path, TileLang's own flags).  TileLang's host code is not kept: the builder reads off its host IR what that code
would do at each call, and the manifest records it for the cuda-python launcher, so the GPU host needs neither
TileLang nor a compiler:

- the kernel call's arguments in order: tensor params (a pointer each), ``CUtensorMap`` params (passed by value,
  ``__grid_constant__``), scalar params;
- per ``CUtensorMap``, its ``cuTensorMapEncodeTiled`` arguments (data type, dims, byte strides, box, swizzle, ...);
  a dim may be a dynamic shape variable, recorded by the name of the scalar param that carries it;
- the launch's threads and dynamic shared memory (the grid comes from the kernel module's ``prepare``, as for
  Triton kernels).

Without TileLang or nvcc, :func:`tilelang_unavailable` says why and the builder skips these kernels; the backend
then runs the Triton forms (nothing is refused at run time).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.compile import AotError
from deepinfer_cuda.kernel_set.cubin import TENSORMAP
from deepinfer_cuda.kernel_set.manifest import KernelEntry, TileLangVariant, sha256_bytes
from deepinfer_cuda.kernel_set.tilelang_kernel import TileLangKernel

#: TileLang's element types -> the manifest's (Triton's spelling, so one launcher packs both kinds).
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "uint8": "u8", "int8": "i8", "int32": "i32",
           "int64": "i64", "uint32": "u32"}
_TENSORMAP_CALL = "__tvm_tensormap_create_tiled"


def tilelang_unavailable() -> str:
    """Why TileLang kernels cannot be built here ("" when they can): TileLang importable, nvcc on the PATH (or
    ``$CUDA_HOME/bin``)."""
    try:
        import tilelang  # noqa: F401
    except ImportError as exc:  # the optional extra: pip install 'deepinfer-backend-cuda[tilelang]'
        return f"tilelang is not installed ({exc})"
    if _nvcc() is None:
        return "no nvcc on the PATH or in $CUDA_HOME/bin"
    return ""


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    found = shutil.which("nvcc")
    if found is None and home and (Path(home) / "bin" / "nvcc").is_file():
        found = str(Path(home) / "bin" / "nvcc")
    return found


def lower(program: Any, arch: CudaArch) -> Any:
    """TileLang's lowering of ``program`` (a ``T.prim_func``) for ``arch``: host IR, device module, CUDA source."""
    from tilelang import tvm
    from tilelang.backend.module import create_backend_context
    from tilelang.engine.lower import lower_with_context

    ctx = create_backend_context({"kind": "cuda", "arch": arch.name}, None, "tvm_ffi")
    # no bounds guards on the kernels' loads: prepare() checks the shapes the variant was built for
    config = {"tl.disable_safe_memory_legalize": True}
    with tvm.transform.PassContext(opt_level=3, config=config), ctx.target:
        return lower_with_context(program, ctx)


def compile_tilelang(kernel: TileLangKernel, arch: CudaArch, variant: TileLangVariant) -> tuple[KernelEntry, bytes]:
    """Compile ``variant`` of ``kernel`` for ``arch``: its manifest entry and cubin bytes."""
    program = kernel.program(**variant.constexprs)
    artifact = lower(program, arch)
    where = f"{kernel.name} [{arch.name}] {variant.constexprs}"
    device = _device_function(artifact.device_mod, where)
    signature, tensormaps = _launch_signature(program, device, _tensormap_calls(artifact.host_mod), where)
    extent = device.attrs["thread_extent"]
    if int(extent.get("threadIdx.y", 1)) != 1 or int(extent.get("threadIdx.z", 1)) != 1:
        raise AotError(f"{where}: 2-D thread blocks are not supported by the cubin launcher")
    source = artifact.kernel_source if kernel.fix_source is None else kernel.fix_source(artifact.kernel_source)
    cubin = nvcc_cubin(source, arch, where)
    key = kernel.key(arch.name, variant.constexprs)
    entry = KernelEntry(
        kernel=kernel.name, arch=arch.name, key=key, entry=str(device.attrs["global_symbol"]),
        cubin=str(Path(arch.name) / f"{kernel.name}-{sha256_bytes(key.encode())[:16]}.cubin"),
        sha256=sha256_bytes(cubin), signature=signature, constexprs=dict(variant.constexprs),
        num_warps=int(extent["threadIdx.x"]) // 32, num_stages=0, num_ctas=1,
        shared=int(device.attrs.get("dyn_shared_memory_buf", 0)), ptx_params=[], hidden_params=[],
        kind="tilelang", tensormaps=tensormaps)
    return entry, cubin


def _device_function(device_mod: Any, where: str) -> Any:
    funcs = [f for _, f in device_mod.functions.items() if "thread_extent" in (f.attrs or {})]
    if len(funcs) != 1:
        raise AotError(f"{where}: expected one device kernel, TileLang made {len(funcs)}")
    return funcs[0]


def _tensormap_calls(host_mod: Any) -> dict[str, list[Any]]:
    """{descriptor name: its ``__tvm_tensormap_create_tiled`` args after the descriptor} from TileLang's host IR."""
    from tilelang import tvm

    recipes: dict[str, list[Any]] = {}

    def visit(node: Any) -> None:
        if (isinstance(node, tvm.tirx.Call) and node.op.name == "tirx.tvm_call_packed"
                and node.args[0].value == _TENSORMAP_CALL):
            recipes[node.args[1].name] = list(node.args[2:])

    for _, func in host_mod.functions.items():
        tvm.tirx.stmt_functor.post_order_visit(func.body, visit)
    return recipes


def _launch_signature(program: Any, device: Any, recipes: dict[str, list[Any]], where: str
                      ) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """The kernel's params in order as ``[name, type]`` (``*bf16``, ``i32``, ``tensormap``; a scalar may be a
    dynamic dim of a tensor, named as declared with ``T.dynamic``) and the recipes of its ``CUtensorMap`` params."""
    buffers = {buf.data.name: (buf.name, buf) for buf in program.buffer_map.values()}
    signature: list[list[str]] = []
    tensormaps: list[dict[str, Any]] = []
    for param in device.params:
        name = param.name
        if name in recipes:
            tensor, recipe = _recipe(recipes[name], buffers, where)
            signature.append([tensor, TENSORMAP])
            tensormaps.append(recipe)
        elif name in buffers:
            signature.append([buffers[name][0], "*" + _DTYPES[str(buffers[name][1].dtype)]])
        elif str(param.dtype) in _DTYPES:
            signature.append([name, _DTYPES[str(param.dtype)]])
        else:
            raise AotError(f"{where}: kernel param {name!r} ({param.dtype}) is neither a tensor, a descriptor nor "
                           "a scalar")
    return signature, tensormaps


def _recipe(args: list[Any], buffers: dict[str, tuple[str, Any]], where: str) -> tuple[str, dict[str, Any]]:
    """(tensor param, recipe) of one ``__tvm_tensormap_create_tiled(desc, dtype, rank, ptr, dims, strides, box,
    elem_strides, interleave, swizzle, l2, oob)`` call (its args after the descriptor)."""
    from tilelang import tvm

    dtype, rank, ptr, rest = int(args[0]), int(args[1]), args[2], args[3:]
    dims, strides, box, elem = (rest[0:rank], rest[rank:2 * rank], rest[2 * rank:3 * rank], rest[3 * rank:4 * rank])
    interleave, swizzle, l2, oob = (int(a) for a in rest[4 * rank: 4 * rank + 4])

    def value(e: Any) -> int | str:
        if isinstance(e, tvm.tirx.IntImm):
            return int(e)
        if isinstance(e, tvm.tirx.Var):
            return e.name  # a dynamic dim: the launch passes it by this name
        raise AotError(f"{where}: TMA dim {e} is neither a constant nor a dynamic dim")

    if ptr.name not in buffers:
        raise AotError(f"{where}: TMA descriptor over {ptr}, not a tensor param")
    strides_ = [value(s) for s in strides[1:]]
    if any(isinstance(s, str) for s in strides_):
        raise AotError(f"{where}: dynamic TMA strides")
    recipe: dict[str, Any] = {"dtype": dtype, "dims": [value(d) for d in dims], "strides": strides_,
                              "box": [int(b) for b in box], "elem_strides": [int(e) for e in elem],
                              "interleave": interleave, "swizzle": swizzle, "l2": l2, "oob": oob}
    return buffers[ptr.name][0], recipe


def nvcc_cubin(source: str, arch: CudaArch, where: str) -> bytes:
    """``nvcc -cubin`` of TileLang's CUDA source for ``arch`` with TileLang's flags and include paths."""
    import tilelang

    root = Path(tilelang.__file__).resolve().parent
    nvcc = _nvcc()
    if nvcc is None:
        raise AotError(f"{where}: no nvcc")
    with tempfile.TemporaryDirectory(prefix="deepinfer-tilelang-") as tmp:
        src, out = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
        src.write_text(source)
        cmd = [nvcc, "-cubin", "-O3", "-std=c++20", "-w", "-lineinfo",
               "-gencode", f"arch=compute_{arch.name[3:]},code={arch.name}",
               f"-I{root / 'src'}", f"-I{root / '3rdparty' / 'cutlass' / 'include'}", str(src), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise AotError(f"{where}: nvcc failed:\n{done.stderr[-4000:]}")
        return out.read_bytes()
