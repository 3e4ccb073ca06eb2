#!/usr/bin/env python
"""Write a tiny random DeepSeek-V4 checkpoint (saved by transformers, released tensor names) for experiments.

    .venv/bin/python tools/make_tiny_v4.py OUT_DIR [--config small|released-rates] [--seed N]
                                                   [--quantize fp4|fp8] [--block 128]

With ``--quantize`` OUT_DIR gets ``source/`` (fp32), ``quantized/`` (FP8 dense projections with UE8M0 block
scales; routed experts MXFP4 for ``fp4``, FP8 for ``fp8``) and ``dequantized/``.  The builders live in
tests/support/v4_fixtures.py, which the oracle tests use too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.support

from tests.support import v4_fixtures  # noqa: E402 - importable only after the sys.path line above

CONFIGS = {"small": v4_fixtures.SMALL, "released-rates": v4_fixtures.RELEASED_RATES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantize", choices=["fp4", "fp8"])
    parser.add_argument("--block", type=int, default=128, help="FP8 block size (square)")
    args = parser.parse_args()
    if args.quantize is None:
        v4_fixtures.build_checkpoint(args.out, CONFIGS[args.config], seed=args.seed)
        print(f"wrote {args.out}")
        return
    source, _ = v4_fixtures.build_checkpoint(args.out / "source", CONFIGS[args.config], seed=args.seed)
    written = v4_fixtures.quantize_checkpoint(source, args.out, expert_dtype=args.quantize, block=(args.block,) * 2)
    print("wrote", source, *written)


if __name__ == "__main__":
    main()
