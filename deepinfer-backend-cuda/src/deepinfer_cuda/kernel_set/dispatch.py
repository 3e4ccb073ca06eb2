"""Pick, per launch, the kernel set's cubin for the live arguments or fall back to Triton JIT.

A :class:`TritonKernel` wraps one ``@triton.jit`` function.  On each call it computes the
specialization Triton's JIT would compile for the arguments (:mod:`.specialize`), looks that variant
up in the active :class:`KernelSet`, and launches the cubin through cuda-python; with no matching cubin
it runs the JIT, which compiles the very same variant.  Which path a variant takes is logged once.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer_cuda.arch import CudaArch, LaunchConfig, arch_for_capability
from deepinfer_cuda.kernel_set.cubin import CubinFunction
from deepinfer_cuda.kernel_set.manifest import (
    MANIFEST_NAME,
    KernelEntry,
    Manifest,
    Variant,
    kernel_sources_digest,
    sha256_bytes,
    variant_key,
)
from deepinfer_cuda.kernel_set.specialize import ParamInfo, params_of, signature_of, tensordesc_type

logger = logging.getLogger("deepinfer.cuda.kernel_set")

#: Where build.sh puts the kernel set: inside the package, so an editable or wheel install finds it.
DEFAULT_KERNEL_SET_DIR = Path(__file__).resolve().parent.parent / "_kernel_set"


class KernelSet:
    """A kernel-set directory as this process can use it: its entries by key, or why it is unusable."""

    def __init__(self, directory: Path | None):
        self.directory = Path(directory) if directory is not None else None
        self.entries: dict[str, KernelEntry] = {}
        self.refusal: str | None = None
        self.manifest: Manifest | None = None
        if self.directory is None:
            self.refusal = "kernel sets are disabled"
            return
        if not (self.directory / MANIFEST_NAME).is_file():
            self.refusal = (f"no {MANIFEST_NAME} in {self.directory} "
                            "(build one: DEEPINFER_ACCELERATOR=nvidia ./build.sh)")
            return
        try:
            manifest = Manifest.read(self.directory)
        except (ValueError, TypeError, KeyError) as exc:
            self.refusal = f"unreadable manifest {self.directory / MANIFEST_NAME}: {exc}"
            return
        import triton

        if manifest.triton_version != triton.__version__:
            self.refusal = (f"built by triton {manifest.triton_version}, this process runs triton "
                            f"{triton.__version__}; cubins from another compiler may differ from the JIT")
            return
        if manifest.kernel_sources != kernel_sources_digest():
            self.refusal = ("built from other kernel sources than this package's (deepinfer_cuda/kernels changed "
                            "since; rebuild: python -m deepinfer_cuda.kernel_set.build)")
            return
        self.manifest = manifest
        self.entries = {e.key: e for e in manifest.kernels}

    @classmethod
    def disabled(cls) -> KernelSet:
        return cls(None)

    def describe(self) -> str:
        if self.refusal is not None:
            return f"kernel set unusable ({self.refusal})"
        assert self.manifest is not None
        return (f"kernel set {self.directory}: {len(self.entries)} cubins for {self.manifest.archs}, "
                f"triton {self.manifest.triton_version}")


_lock = threading.Lock()
_active: KernelSet | None = None


def active_kernel_set() -> KernelSet:
    """The process-wide kernel set (loaded from :data:`DEFAULT_KERNEL_SET_DIR` on first use)."""
    global _active
    with _lock:
        if _active is None:
            _active = KernelSet(DEFAULT_KERNEL_SET_DIR)
            quiet = _active.refusal is None or "no manifest" in _active.refusal
            log = logger.info if quiet else logger.warning
            log("%s%s", _active.describe(), "; kernels run through Triton JIT" if _active.refusal else "")
        return _active


def use_kernel_set(kernel_set: KernelSet | Path | None) -> KernelSet:
    """Make ``kernel_set`` (a KernelSet, a directory, or None to disable) the active one; return it."""
    global _active
    ks = kernel_set if isinstance(kernel_set, KernelSet) else KernelSet(kernel_set)
    with _lock:
        _active = ks
    for kernel in _KERNELS:
        kernel.reset()
    logger.info("%s", ks.describe())
    return ks


_KERNELS: list[TritonKernel] = []


@dataclass(slots=True)
class Launch:
    """One planned launch, built by a kernel module's ``prepare(*op_args, arch=...)`` without touching a GPU.

    ``result`` is what the op returns once the kernel has run (outputs allocated on the inputs' device), so the
    same plan runs through a cubin, the JIT, or Triton's CPU interpreter in tests.
    """

    grid: tuple[int, ...]
    config: LaunchConfig
    args: dict[str, Any]
    result: Any

    def run(self, kernel: TritonKernel, device_index: int) -> Any:
        if 0 not in self.grid:
            kernel.launch(self.grid, self.config, self.args, device_index)
        return self.result


@dataclass(slots=True)
class LaunchChain:
    """Launches of several kernels that run in order on the same stream, then ``finish()`` builds the op's result
    (for ops that are more than one kernel, e.g. MoE experts: two GEMMs and a sum in torch)."""

    steps: list[tuple[TritonKernel, Launch]]
    finish: Callable[[], Any]

    def run(self, device_index: int) -> Any:
        for kernel, launch in self.steps:
            launch.run(kernel, device_index)
        return self.finish()


def cuda_target(t: Any) -> tuple[int, CudaArch]:
    """(device index, kernel-set architecture) of the CUDA tensor ``t``; raises where the set has no arch."""
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    arch = device_arch(index)
    if arch is None:
        raise RuntimeError(f"no kernel configuration for the GPU of {t.device} "
                           f"(capability {torch.cuda.get_device_capability(index)})")
    return index, arch


def _value_spec(v: Any) -> Any:
    """What of a runtime argument Triton's specialization can depend on (tensor: dtype and 16-byte alignment;
    int: 1, divisibility by 16, width), as a hashable value."""
    if isinstance(v, torch.Tensor):
        return v.dtype, not v.data_ptr() & 15
    if isinstance(v, bool):
        return bool
    if isinstance(v, int):
        return v == 1, v & 15 == 0, -(2**31) <= v < 2**31, v >= 2**63
    if isinstance(v, float):
        return float
    if isinstance(v, TensorDescriptor):
        return tensordesc_type(v)
    return v


def _current_stream(device_index: int) -> int:
    """torch's current raw stream handle on ``device_index`` (the private call Triton's launcher uses too)."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return getter(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


@functools.cache
def device_arch(device_index: int) -> CudaArch | None:
    """The kernel-set architecture of CUDA device ``device_index`` (None: the set has none for it)."""
    return arch_for_capability(torch.cuda.get_device_capability(device_index))


class TritonKernel:
    """A Triton kernel, launched from the kernel set's cubin when one matches, else through Triton JIT.

    ``aot_variants(arch)`` lists the specializations the kernel-set builder compiles for ``arch``;
    wrappers must launch with the launch configuration the same arch module gives, so AOT and JIT
    compile identical code.
    """

    def __init__(self, name: str, jit_fn: Any, aot_variants: Callable[[CudaArch], Iterable[Variant]]):
        self.name = name
        self.jit_fn = jit_fn
        self.aot_variants = aot_variants
        self.params: list[ParamInfo] = params_of(jit_fn)
        self._pairs = [(p.name, p.is_constexpr) for p in self.params]
        #: Launches per path since the last reset: {"cubin": n, "jit": n}.
        self.launch_counts: dict[str, int] = {"cubin": 0, "jit": 0}
        self._resolved: dict[tuple[Any, ...], CubinFunction | None] = {}
        _KERNELS.append(self)

    def has_aot_variant(self, launch: Launch, arch: CudaArch) -> bool:
        """Whether the kernel set builds a cubin for ``launch``'s specialization on ``arch`` (no GPU needed): what
        tests check so that a model's calls never fall back to the JIT."""
        signature, constexprs = signature_of(self.params, launch.args)
        cfg = launch.config
        key = variant_key(self.name, arch.name, signature, constexprs, cfg.num_warps, cfg.num_stages)
        return key in {variant_key(self.name, arch.name, v.signature, v.constexprs, v.num_warps, v.num_stages)
                       for v in self.aot_variants(arch)}

    def reset(self) -> None:
        """Forget resolved variants (after the active kernel set changed)."""
        self._resolved.clear()
        self.launch_counts = {"cubin": 0, "jit": 0}

    def __call__(self, grid: tuple[int, ...], *, num_warps: int, num_stages: int, **args: Any) -> None:
        self.launch(grid, LaunchConfig(num_warps=num_warps, num_stages=num_stages), args, torch.cuda.current_device())

    def launch(self, grid: tuple[int, ...], config: LaunchConfig, args: dict[str, Any], device_index: int) -> None:
        """Launch on ``device_index`` (made current if it is not): the per-launch path, kept short because a
        prefill makes ~200 of these from Python (one device query, one spec tuple, one dict lookup)."""
        if torch.cuda.current_device() != device_index:
            with torch.cuda.device(device_index):
                return self.launch(grid, config, args, device_index)
        num_warps, num_stages = config.num_warps, config.num_stages
        slot = (self._fast_spec(args), num_warps, num_stages, device_index)
        try:
            fn = self._resolved[slot]
        except KeyError:  # this specialization's first launch: its cubin, or None for the JIT
            arch = device_arch(device_index)
            signature, constexprs = signature_of(self.params, args)
            key = variant_key(self.name, arch.name if arch else "?", signature, constexprs, num_warps, num_stages)
            fn = self._resolved[slot] = self._resolve(key, arch, device_index)
        if fn is not None:
            fn.launch(grid, _current_stream(device_index), args)
            self.launch_counts["cubin"] += 1
        else:
            self.jit_fn[grid](**args, num_warps=num_warps, num_stages=num_stages)
            self.launch_counts["jit"] += 1

    def _fast_spec(self, args: dict[str, Any]) -> tuple[Any, ...]:
        """A hashable summary at least as fine as Triton's specialization (:func:`_value_spec` per argument),
        cheap enough for every launch: plain tensors and ints, nearly every argument, are summarised inline."""
        spec: list[Any] = []
        append = spec.append
        for name, constexpr in self._pairs:
            v = args[name]
            if constexpr:
                append(v)
            elif type(v) is torch.Tensor:
                append((v.dtype, not v.data_ptr() & 15))
            elif type(v) is int:
                append((v == 1, not v & 15, -(2**31) <= v < 2**31, v >= 2**63))
            else:
                append(_value_spec(v))
        return tuple(spec)

    def _resolve(self, key: str, arch: CudaArch | None, device_index: int) -> CubinFunction | None:
        ks = active_kernel_set()
        entry = ks.entries.get(key)
        if entry is None:
            why = ks.refusal or ("the GPU's architecture has no kernel set" if arch is None
                                 else "no cubin was built for this specialization")
            logger.info("kernel %s: no cubin for %s (%s); using Triton JIT", self.name, key, why)
            return None
        assert ks.directory is not None
        try:
            cubin = (ks.directory / entry.cubin).read_bytes()
            if sha256_bytes(cubin) != entry.sha256:
                raise RuntimeError("its sha256 differs from the manifest's")
            fn = CubinFunction(entry, cubin, device_index)
        except (OSError, RuntimeError) as exc:
            logger.warning("kernel %s: cubin %s failed to load (%s); using Triton JIT", self.name, entry.cubin, exc)
            return None
        logger.info("kernel %s: launching AOT cubin %s (%s)", self.name, entry.cubin, entry.arch)
        return fn
