"""Build a kernel set: every AOT variant of every kernel, for each architecture, into one directory.

Needs Triton, not a GPU.  ``build.sh`` runs it with ``DEEPINFER_ACCELERATOR=nvidia``; by default it writes into the
installed package (``deepinfer_cuda/_kernel_set``), where the backend looks at run time::

    python -m deepinfer_cuda.kernel_set.build [--out DIR] [--arch sm_90a --arch sm_100a] [--kernel rms_norm]
"""

from __future__ import annotations

import argparse
import logging
import platform
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import triton

from deepinfer_cuda.arch import ARCHS, CudaArch, arch_by_name
from deepinfer_cuda.kernel_set.compile import compile_variant
from deepinfer_cuda.kernel_set.dispatch import DEFAULT_KERNEL_SET_DIR
from deepinfer_cuda.kernel_set.manifest import MANIFEST_NAME, Manifest, kernel_sources_digest
from deepinfer_cuda.ops import aot_kernels, tilelang_kernels

logger = logging.getLogger("deepinfer.cuda.kernel_set")


def build_kernel_set(out_dir: Path, archs: Sequence[CudaArch] = ARCHS,
                     kernels: Iterable[str] | None = None) -> Manifest:
    """Compile into ``out_dir`` (replacing a kernel set there) and write its manifest; return the manifest.

    ``kernels`` limits the build to those kernel names (default: every kernel an ``@override`` names in ``aot``).
    """
    every, every_tl = aot_kernels(), tilelang_kernels()
    selected = [k for k in every if kernels is None or k.name in set(kernels)]
    selected_tl = [k for k in every_tl if kernels is None or k.name in set(kernels)]
    if kernels is not None and len(selected) + len(selected_tl) != len(set(kernels)):
        known = {k.name for k in every} | {k.name for k in every_tl}
        raise ValueError(f"unknown kernels {sorted(set(kernels) - known)}; known: {sorted(known)}")
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
    manifest.tilelang_skipped = _build_tilelang(out_dir, archs, selected_tl, manifest) if selected_tl else ""
    manifest.write(out_dir)
    logger.info("kernel set %s: %d cubins for %s in %.1fs (triton %s)", out_dir, len(manifest.kernels),
                manifest.archs, time.perf_counter() - start, manifest.triton_version)
    return manifest


def _build_tilelang(out_dir: Path, archs: Sequence[CudaArch], kernels: list[Any], manifest: Manifest) -> str:
    """Add the TileLang kernels' cubins (an optional step: without TileLang or nvcc it logs why, adds none and
    returns the reason; the backend then plans the Triton forms)."""
    from deepinfer_cuda.kernel_set.tilelang_compile import compile_tilelang, tilelang_unavailable

    why = tilelang_unavailable()
    if why:
        logger.warning("kernel set: TileLang kernels skipped: %s", why)
        return why
    import tilelang

    manifest.built_with["tilelang"] = tilelang.__version__
    for arch in archs:
        for kernel in kernels:
            for variant in kernel.aot_variants(arch):
                entry, cubin = compile_tilelang(kernel, arch, variant)
                (out_dir / entry.cubin).write_bytes(cubin)
                manifest.kernels.append(entry)
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer_cuda.kernel_set.build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_KERNEL_SET_DIR, help="kernel-set directory (replaced)")
    parser.add_argument("--arch", action="append", choices=[a.name for a in ARCHS],
                        help="architecture to build for (repeatable; default: all)")
    parser.add_argument("--kernel", action="append", help="kernel to build (repeatable; default: all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    archs = [arch_by_name(a) for a in args.arch] if args.arch else list(ARCHS)
    manifest = build_kernel_set(args.out, archs, args.kernel)
    print(f"{len(manifest.kernels)} cubins for {', '.join(manifest.archs)} (triton {manifest.triton_version}) "
          f"in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
