"""The kernel-set manifest: which cubins exist, for which arch and specialization, and how to launch them.

A kernel set is a directory::

    manifest.json
    sm_90a/<kernel>-<key hash>.cubin
    sm_100a/...

Each entry records what the launcher needs without Triton's help: the entry point's name, the explicit
parameters (Triton type strings, constexprs removed), the hidden parameters Triton appended after them,
the launch shape (warps, CTAs, dynamic shared memory), and the specialization it was compiled for.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Bump when the layout of manifest.json changes incompatibly.
MANIFEST_FORMAT = 1
MANIFEST_NAME = "manifest.json"

#: Hidden trailing parameters each Triton version family appends, by count (read off the PTX at build).
HIDDEN_PARAMS_BY_COUNT: dict[int, tuple[str, ...]] = {
    0: (),
    1: ("global_scratch",),
    2: ("global_scratch", "profile_scratch"),
}


def variant_key(kernel: str, arch: str, signature: dict[str, str], constexprs: dict[str, Any],
                num_warps: int, num_stages: int) -> str:
    """A stable string naming one compiled variant; the runtime computes the same from live arguments.

    ``signature`` maps each non-constexpr argument to Triton's type plus specialization, e.g.
    ``"*bf16:D"`` (pointer, 16-byte aligned) or ``"i32"``; ``constexprs`` holds JSON-able values.
    """
    sig = ",".join(f"{k}={v}" for k, v in signature.items())
    const = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(constexprs.items()))
    return f"{kernel}|{arch}|{sig}|{const}|w{num_warps}s{num_stages}"


@dataclass(slots=True, frozen=True)
class Variant:
    """One specialization to compile: what :func:`.specialize.signature_of` yields for some live call (its
    :func:`variant_key` names the cubin)."""

    signature: dict[str, str]  #: runtime params in order: name -> "*bf16:D", "i32:D", "fp32", ...
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 1


@dataclass(slots=True, frozen=True)
class TileLangVariant:
    """One TileLang specialization to compile: the program builder's keyword arguments (all compile-time)."""

    constexprs: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class KernelEntry:
    """One cubin: a kernel compiled for one arch and one specialization."""

    kernel: str  #: our kernel name (the Python module's KERNEL.name)
    arch: str  #: "sm_90a" / "sm_100a"
    key: str  #: :func:`variant_key` of this variant
    entry: str  #: the cubin's function symbol (cuModuleGetFunction)
    cubin: str  #: path relative to the kernel-set directory
    sha256: str  #: of the cubin bytes
    signature: list[list[str]]  #: explicit params in launch order: [name, Triton type (+ ":D" if 16-divisible)]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    num_ctas: int
    shared: int  #: dynamic shared memory bytes to launch with
    ptx_params: list[str]  #: PTX types of every .param in order, hidden ones included (.u64, .u32, .f32 ...)
    hidden_params: list[str]  #: names of the trailing hidden params; launched as null pointers
    launch_cooperative_grid: bool = False
    launch_pdl: bool = False
    #: per TMA descriptor param, in order: how Triton lowered it (swizzle, elem_size, elem_type, block_size), which
    #: the launcher encodes the ``CUtensorMap`` with (the block may be split into 128-byte boxes)
    tensordesc_meta: list[dict[str, Any]] = field(default_factory=list)
    #: "triton", or "tilelang": a TileLang kernel compiled to CUDA C++ and by nvcc (``tilelang_compile.py``)
    kind: str = "triton"
    #: TileLang only: per ``tensormap`` param, the ``CUtensorMap`` recipe TileLang's host code would encode (the
    #: tensor param it describes, data type, dims innermost first (an int, or the name of a scalar param), byte
    #: strides, box, element strides, interleave, swizzle, L2 promotion, out-of-bounds fill)
    tensormaps: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Manifest:
    """Everything in manifest.json."""

    triton_version: str
    archs: list[str]
    kernels: list[KernelEntry] = field(default_factory=list)
    format: int = MANIFEST_FORMAT
    built_with: dict[str, str] = field(default_factory=dict)  #: tool versions, for the record
    #: :func:`kernel_sources_digest` of the sources it was built from (a set from other sources is refused)
    kernel_sources: str = ""
    #: why no TileLang cubins were built ("" when they were, or the build selected no TileLang kernel)
    tilelang_skipped: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        if raw.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"kernel-set manifest format {raw.get('format')!r}; this backend reads {MANIFEST_FORMAT}")
        kernels = [KernelEntry(**k) for k in raw.pop("kernels")]
        return cls(kernels=kernels, **raw)

    def write(self, directory: Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        return cls.from_json((Path(directory) / MANIFEST_NAME).read_text())


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def kernel_sources_digest() -> str:
    """sha256 over the backend's kernel sources (``deepinfer_cuda/kernels/*.py``, by name).

    Variant keys name a specialization, not the code, so a cubin built before a kernel changed would still match
    its key: the manifest records this digest and the runtime refuses a set whose digest differs."""
    digest = hashlib.sha256()
    for path in sorted((Path(__file__).resolve().parent.parent / "kernels").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
