#!/usr/bin/env python
"""Compile the CUDA backend's Triton kernels ahead of time into a kernel set (cubins + manifest.json).

Needs Triton, not a GPU.  build.sh runs it with DEEPINFER_ACCELERATOR=nvidia; by default it writes into
the installed package (deepinfer_cuda/_kernel_set), where the backend looks at run time.

    python tools/build_kernel_set.py [--out DIR] [--arch sm_90a --arch sm_100a] [--kernel rms_norm]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from deepinfer_cuda.arch import ARCHS, arch_by_name
    from deepinfer_cuda.kernel_set.build import build_kernel_set
    from deepinfer_cuda.kernel_set.dispatch import DEFAULT_KERNEL_SET_DIR

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
