"""Build a kernel set: every AOT variant of every kernel, for each architecture, into one directory."""

from __future__ import annotations

import logging
import platform
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from deepinfer_cuda.arch import ARCHS, CudaArch
from deepinfer_cuda.kernel_set.compile import compile_variant
from deepinfer_cuda.kernel_set.manifest import MANIFEST_NAME, Manifest, kernel_sources_digest

logger = logging.getLogger("deepinfer.cuda.kernel_set")


def build_kernel_set(out_dir: Path, archs: Sequence[CudaArch] = ARCHS,
                     kernels: Iterable[str] | None = None) -> Manifest:
    """Compile into ``out_dir`` (replacing a kernel set there) and write its manifest; return the manifest.

    ``kernels`` limits the build to those kernel names (default: all of :data:`deepinfer_cuda.kernels.ALL`).
    """
    import triton

    from deepinfer_cuda.kernels import ALL

    selected = [k for k in ALL if kernels is None or k.name in set(kernels)]
    if kernels is not None and len(selected) != len(set(kernels)):
        unknown = sorted(set(kernels) - {k.name for k in ALL})
        raise ValueError(f"unknown kernels {unknown}; known: {sorted(k.name for k in ALL)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for arch in ARCHS:  # only directories this builder owns
        shutil.rmtree(out_dir / arch.name, ignore_errors=True)

    manifest = Manifest(
        triton_version=triton.__version__,
        archs=[a.name for a in archs],
        built_with={"python": platform.python_version(), "triton": triton.__version__},
        kernel_sources=kernel_sources_digest(),
    )
    start = time.perf_counter()
    for arch in archs:
        (out_dir / arch.name).mkdir()
        for kernel in selected:
            for variant in kernel.aot_variants(arch):
                entry, cubin = compile_variant(kernel, arch, variant)
                (out_dir / entry.cubin).write_bytes(cubin)
                manifest.kernels.append(entry)
    manifest.write(out_dir)
    logger.info("kernel set %s: %d cubins for %s in %.1fs (triton %s)", out_dir, len(manifest.kernels),
                manifest.archs, time.perf_counter() - start, manifest.triton_version)
    return manifest
