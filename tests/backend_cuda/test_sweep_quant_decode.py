"""``python -m tools.sweep.quant_decode --tiny`` end to end on the CPU (Triton's interpreter): every candidate of the
tiny cases runs the op's plan with its tiles and matches core's reference (``err`` 0 or within the FP8 / MXFP4 bounds,
no ``BAD`` row), and the summary prints the entries to paste into ``arch.py``.  The GPU run is the lead's:
``python -m tools.sweep.quant_decode`` on the H200."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~30 s; the kernels the sweep times are checked by test_kernels_interpreted.py
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: run the sweep itself there")
def test_the_sweep_runs_tiny_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-m", "tools.sweep.quant_decode", "--tiny"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    out = proc.stdout
    assert "BAD" not in out, out
    assert out.count("Fp8DecodeTile(") == 4, out  # two tiny shapes x two row tiers
    assert "Mxfp4Tiles(MoeTiles(16" in out and "row_loop=True" in out, out


def test_the_summary_prints_tma_tiles_as_pasteable_entries(capsys, monkeypatch):
    """A TMA candidate that wins prints as ``Fp8DecodeTile(..., tma=True)``, which evaluates to that tile."""
    from deepinfer_cuda.arch import Fp8DecodeTile
    from tools.sweep import quant_decode as sweep

    case = {"op": "fp8", "n": 96, "k": 256, "groups": 1, "rows": 1, "tier": 1, "bytes": 1, "err": 0.0}
    tiles = [Fp8DecodeTile(True, 4, 512, 1, 4, 1), Fp8DecodeTile(True, 8, 1024, 2, 4, 3, tma=True)]
    rows = [{**case, **{f: getattr(t, f) for f in t.__slots__}, "us": us, "default": not i}
            for i, (t, us) in enumerate(zip(tiles, (2.0, 1.0), strict=True))]
    sweep.summary(rows, sweep.TINY_MOE)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "Fp8DecodeTile(" in ln)
    assert eval(line.split(": ", 1)[1].split(",  #")[0], {"Fp8DecodeTile": Fp8DecodeTile}) == tiles[1], line
    assert sweep.cand_label(tiles[1]).endswith(" tma")
