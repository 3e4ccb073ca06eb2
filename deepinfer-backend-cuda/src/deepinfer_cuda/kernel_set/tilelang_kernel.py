"""A TileLang kernel as the kernel set ships it: cubins built ahead of time, launched by the cubin launcher.

Unlike :class:`~deepinfer_cuda.kernel_set.dispatch.TritonKernel` there is no JIT fallback (the GPU host runs no
TileLang): a variant runs only if the active kernel set holds its cubin, so the op wrappers ask :meth:`available`
first and otherwise plan the Triton form.  The variant key is the kernel, the arch and the program builder's
compile-time arguments; the launch's arguments are matched to the manifest's signature by name.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepinfer_cuda.arch import CudaArch, LaunchConfig
from deepinfer_cuda.kernel_set.cubin import CubinFunction
from deepinfer_cuda.kernel_set.dispatch import _KERNELS, _current_stream, active_kernel_set
from deepinfer_cuda.kernel_set.manifest import TileLangVariant, sha256_bytes

logger = logging.getLogger("deepinfer.cuda.kernel_set")


class TileLangKernel:
    """``program(**constexprs)`` builds the ``T.prim_func`` (imports TileLang: build time only);
    ``aot_variants(arch)`` lists the specializations the builder compiles; ``fix_source`` (optional) rewrites
    TileLang's CUDA source before nvcc, for what the program cannot say in TileLang (it must fail loudly when the
    source is not the shape it expects)."""

    def __init__(self, name: str, program: Callable[..., Any],
                 aot_variants: Callable[[CudaArch], Iterable[TileLangVariant]],
                 fix_source: Callable[[str], str] | None = None):
        self.name = name
        self.program = program
        self.aot_variants = aot_variants
        self.fix_source = fix_source
        self.launch_counts: dict[str, int] = {"cubin": 0, "jit": 0}
        self._loaded: dict[tuple[str, int], CubinFunction | None] = {}
        _KERNELS.append(self)  # type: ignore[arg-type]  # reset with the Triton kernels when the set changes

    def key(self, arch: str, constexprs: dict[str, Any]) -> str:
        return f"{self.name}|{arch}|tilelang|{json.dumps(constexprs, sort_keys=True)}"

    def available(self, arch: CudaArch, constexprs: dict[str, Any]) -> bool:
        """Whether the active kernel set holds this variant's cubin (no GPU needed)."""
        return self.key(arch.name, constexprs) in active_kernel_set().entries

    def has_aot_variant(self, constexprs: dict[str, Any], arch: CudaArch) -> bool:
        """Whether the builder compiles this variant for ``arch``."""
        return any(v.constexprs == constexprs for v in self.aot_variants(arch))

    def reset(self) -> None:
        self._loaded.clear()
        self.launch_counts = {"cubin": 0, "jit": 0}

    def launch(self, grid: tuple[int, ...], config: LaunchConfig, args: dict[str, Any], device_index: int) -> None:
        """Launch the cubin of ``args["constexprs"]`` (the variant) on torch's current stream."""
        if torch.cuda.current_device() != device_index:
            with torch.cuda.device(device_index):
                return self.launch(grid, config, args, device_index)
        from deepinfer_cuda.kernel_set.dispatch import device_arch

        arch = device_arch(device_index)
        key = self.key(arch.name if arch else "?", args["constexprs"])
        slot = (key, device_index)
        fn = self._loaded[slot] if slot in self._loaded else self._load(key, slot, device_index)
        if fn is None:
            raise RuntimeError(f"kernel {self.name}: no cubin for {key} in the active kernel set "
                               "(TileLang kernels have no JIT: plan the Triton form when available() is False)")
        fn.launch(grid, _current_stream(device_index), args)
        self.launch_counts["cubin"] += 1

    def _load(self, key: str, slot: tuple[str, int], device_index: int) -> CubinFunction | None:
        ks = active_kernel_set()
        entry = ks.entries.get(key)
        fn = None
        if entry is not None and ks.directory is not None:
            cubin = (ks.directory / entry.cubin).read_bytes()
            if sha256_bytes(cubin) != entry.sha256:
                raise RuntimeError(f"kernel {self.name}: cubin {entry.cubin} differs from the manifest's sha256")
            fn = CubinFunction(entry, cubin, device_index)
            logger.info("kernel %s: launching TileLang cubin %s (%s)", self.name, entry.cubin, entry.arch)
        self._loaded[slot] = fn
        return fn
