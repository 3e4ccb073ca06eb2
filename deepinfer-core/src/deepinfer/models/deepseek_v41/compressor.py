"""V4.1's compressor (kv-source layers): one pre-RoPE latent per closed window of ``ratio`` tokens.

At ratio > 1 (the encoder) each token is projected in fp32 to ``kv | gate`` (``head_dim`` each, one series, no
overlap, no position bias); a closed window's latent is ``sum_j softmax_j(gate_j) * kv_j`` per channel in fp32,
cast to the model dtype and RMS-normalised.  At ratio 1 (the decoder's kv source) every token is its own window:
``norm(wkv(x))``.  The latent feeds both the group's compressed entries (rotated at the window's first position,
then FP4) and its indexer keys (see :class:`~.indexer.Indexer`), which is why it is returned before RoPE.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.kv.decode_plan import RatioPlan
from deepinfer.kv.layout import RaggedLayout
from deepinfer.kv.pool import PooledState
from deepinfer.layers.compressor import CompressorWindows
from deepinfer.models.deepseek_v41.verify_step import VerifyRecord
from deepinfer.ops import Ops


class Compressor:
    def __init__(self, ops: Ops, get: Callable[[str], torch.Tensor], prefix: str, *, ratio: int, eps: float):
        self.ops, self.ratio, self.eps = ops, ratio, eps
        self.norm = get(prefix + "norm.weight")
        wkv = get(prefix + "wkv.weight")
        self.dim = wkv.shape[0]
        if ratio == 1:
            self.wkv = wkv
        else:  # one fp32 GEMM for kv | gate, as the reference projects them
            self.w = torch.cat([wkv, get(prefix + "wgate.weight")]).float()
            self.windows = CompressorWindows(ratio, self.dim, overlap=False)

    def _latents(self, windows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[n, dim] latents of windows [n, r, 2 * dim] (fp32 kv | gate)."""
        pooled = self.ops.compress_pool(windows[..., : self.dim], windows[..., self.dim :])
        return self.ops.rms_norm(pooled.to(dtype), self.norm, self.eps)

    def ragged(self, x: torch.Tensor, layout: RaggedLayout, states: list[PooledState],
               pending: torch.Tensor | None) -> torch.Tensor | None:
        """Latents of the windows the step closes, in the plan's ``closed_*`` order (None: it closes none);
        ``x`` [T, D]: the layer's normalised input.  The carry-over is updated either way."""
        if self.ratio == 1:
            return self.ops.rms_norm(self.ops.linear(x, self.wkv), self.norm, self.eps)
        assert pending is not None
        closed = self.windows.ragged(self.ops.linear(x.float(), self.w), layout, states, pending, None)
        return None if closed is None else self._latents(closed[0], x.dtype)

    def decode(self, x: torch.Tensor, slots: torch.Tensor, plan: RatioPlan, pending: torch.Tensor | None,
               record: VerifyRecord | None = None) -> torch.Tensor:
        """Every row's latent [B, dim] (only closing rows' are entries: ``plan.closing``).  A verify step
        (``record``) takes each row's window from the step's rows and the carry-over (``plan.block``) and leaves
        the carry-over to :func:`~.verify_step.commit` (its projections go to ``record``)."""
        if self.ratio == 1:
            return self.ops.rms_norm(self.ops.linear(x, self.wkv), self.norm, self.eps)
        assert pending is not None
        proj = self.ops.linear(x.float(), self.w)
        if record is None:
            window, _ = self.windows.decode(proj, slots, plan, pending, None)
        else:
            record.pending.append((pending, proj))
            window = self.windows.block(proj, plan, pending)
        return self._latents(window, x.dtype)
