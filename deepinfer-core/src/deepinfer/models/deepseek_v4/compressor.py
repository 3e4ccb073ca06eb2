"""The KV compressor of CSA / HCA layers (paper §2.3): gated pooling of every ``ratio`` tokens into one entry.

Each token is projected to ``kv`` and ``gate``; a closed window's entry is ``sum_j softmax_j(gate_j + bias_j) *
kv_j`` per channel, RMS-normalised, then rotated (compress RoPE) at the window's first position.
With ``overlap`` (CSA) the projections are twice as wide, holding two series a and b: entry ``w`` pools series
b of window ``w`` together with series a of window ``w - 1`` (width ``2 * ratio``, stride ``ratio``).
Tokens of an unfinished window, and series a of the last closed one, wait in the sequence's state.
"""

from __future__ import annotations

import torch

from deepinfer.models.deepseek_v4.layout import RaggedLayout
from deepinfer.models.deepseek_v4.state import CompressorState
from deepinfer.ops import OpTable


class Compressor:
    def __init__(
        self,
        ops: OpTable,
        wkv: torch.Tensor,
        wgate: torch.Tensor,
        position_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        *,
        ratio: int,
        overlap: bool,
        eps: float,
        inv_freq: torch.Tensor,
        rope_scaling: float,
    ):
        self.ops, self.wkv, self.wgate = ops, wkv, wgate
        self.position_bias, self.norm_weight = position_bias, norm_weight
        self.ratio, self.overlap, self.eps = ratio, overlap, eps
        self.inv_freq, self.rope_scaling = inv_freq, rope_scaling
        self.width = wkv.shape[0]
        self.dim = self.width // 2 if overlap else self.width

    def new_state(self, dtype: torch.dtype, device: torch.device) -> CompressorState:
        return CompressorState.empty(self.width, self.dim, dtype, device)

    def _windows(self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState):
        """Slots ``[n, S, dim]`` (kv, fp32 score) of the windows this chunk closes; updates the carry-over."""
        r, d = self.ratio, self.dim
        kv = torch.cat([state.pending_kv, kv])
        gate = torch.cat([state.pending_gate, gate])
        n = kv.shape[0] // r
        if n == 0:  # nothing closes (most decode steps): the concatenation is the new carry-over as it is
            state.pending_kv, state.pending_gate = kv, gate
            return None
        state.pending_kv, state.pending_gate = kv[n * r :].clone(), gate[n * r :].clone()
        kv, gate = kv[: n * r].view(n, r, -1), gate[: n * r].view(n, r, -1)
        score = gate.float() + self.position_bias
        if not self.overlap:
            return kv, score
        # Series a of the previous window fills the first r slots; none before the very first window.
        prev_kv = kv.new_zeros(n, r, d)
        prev_score = score.new_full((n, r, d), float("-inf"))
        prev_kv[1:], prev_score[1:] = kv[:-1, :, :d], score[:-1, :, :d]
        if state.overlap_kv is not None:
            prev_kv[0] = state.overlap_kv
            prev_score[0] = state.overlap_gate.float() + self.position_bias[:, :d]
        state.overlap_kv, state.overlap_gate = kv[-1, :, :d].clone(), gate[-1, :, :d].clone()
        return torch.cat([prev_kv, kv[..., d:]], dim=1), torch.cat([prev_score, score[..., d:]], dim=1)

    def __call__(self, x: torch.Tensor, layout: RaggedLayout, states: list[CompressorState]) -> list[torch.Tensor]:
        """Feed the new tokens ``x`` [T, hidden]; returns every sequence's compressed entries so far [n_i, dim]."""
        kv, gate = self.ops.linear(x, self.wkv), self.ops.linear(x, self.wgate)
        slot_kv, slot_score, positions, counts = [], [], [], []
        for i, state in enumerate(states):
            rows = layout.rows(i)
            windows = self._windows(kv[rows], gate[rows], state)
            counts.append(0 if windows is None else windows[0].shape[0])
            if windows is not None:
                slot_kv.append(windows[0])
                slot_score.append(windows[1])
                first = state.num_entries
                positions.append(torch.arange(first, first + counts[-1], device=x.device) * self.ratio)
        if slot_kv:
            pooled = self.ops.compress_pool(torch.cat(slot_kv), torch.cat(slot_score))
            entries = self.ops.rms_norm(pooled, self.norm_weight, self.eps)
            entries = self.ops.rope(entries, torch.cat(positions), self.inv_freq, self.rope_scaling)
            for state, new in zip(states, entries.split(counts)):
                if new.shape[0]:
                    state.append_entries(new)
        return [state.entries for state in states]
