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
from deepinfer.models.deepseek_v4.state import DeepseekV4State
from deepinfer.models.deepseek_v4.state_pool import CompressorCache, StatePool
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

    def _entries(self, slot_kv: torch.Tensor, slot_score: torch.Tensor, first_pos: torch.Tensor) -> torch.Tensor:
        """Pool windows ``[n, S, dim]`` into entries, RMS-normalised and rotated at each window's first position."""
        pooled = self.ops.compress_pool(slot_kv, slot_score)
        entries = self.ops.rms_norm(pooled, self.norm_weight, self.eps)
        return self.ops.rope(entries, first_pos, self.inv_freq, self.rope_scaling)

    # --- any chunk lengths (prefill, mixed steps) ---------------------------------------------------
    def _windows(self, kv: torch.Tensor, gate: torch.Tensor, cache: CompressorCache, slot: int, start: int):
        """Slots ``[n, S, dim]`` (kv, fp32 score) of the windows a chunk starting at ``start`` closes; updates
        the slot's carry-over."""
        r, d = self.ratio, self.dim
        held = start % r  # tokens of the unfinished window already in the slot
        kv = torch.cat([cache.pending_kv[slot, :held], kv])
        gate = torch.cat([cache.pending_gate[slot, :held], gate])
        n = kv.shape[0] // r
        rest = kv.shape[0] - n * r
        cache.pending_kv[slot, :rest] = kv[n * r :]
        cache.pending_gate[slot, :rest] = gate[n * r :]
        if n == 0:
            return None
        kv, gate = kv[: n * r].view(n, r, -1), gate[: n * r].view(n, r, -1)
        score = gate.float() + self.position_bias
        if not self.overlap:
            return kv, score
        # Series a of the previous window fills the first r slots; none before the very first window.
        prev_kv = kv.new_zeros(n, r, d)
        prev_score = score.new_full((n, r, d), float("-inf"))
        prev_kv[1:], prev_score[1:] = kv[:-1, :, :d], score[:-1, :, :d]
        if start >= r:
            prev_kv[0] = cache.overlap_kv[slot]
            prev_score[0] = cache.overlap_gate[slot].float() + self.position_bias[:, :d]
        cache.overlap_kv[slot], cache.overlap_gate[slot] = kv[-1, :, :d], gate[-1, :, :d]
        return torch.cat([prev_kv, kv[..., d:]], dim=1), torch.cat([prev_score, score[..., d:]], dim=1)

    def __call__(self, x: torch.Tensor, layout: RaggedLayout, states: list[DeepseekV4State], pool: StatePool,
                 cache: CompressorCache, out: torch.Tensor, base: int) -> list[torch.Tensor]:
        """Feed the new tokens ``x`` [T, hidden]; entries of closed windows go to ``out`` rows ``base +`` page
        rows.  Returns every sequence's page rows (relative to ``base``) of all its entries so far."""
        kv, gate = self.ops.linear(x, self.wkv), self.ops.linear(x, self.wgate)
        slot_kv, slot_score, positions, rows, all_rows = [], [], [], [], []
        for i, state in enumerate(states):
            start, end = layout.starts[i], layout.starts[i] + layout.lens[i]
            seq_rows = pool.page_rows(state, self.ratio)
            all_rows.append(seq_rows[: end // self.ratio])
            windows = self._windows(kv[layout.rows(i)], gate[layout.rows(i)], cache, state.slot, start)
            if windows is not None:
                first, n = start // self.ratio, windows[0].shape[0]
                slot_kv.append(windows[0])
                slot_score.append(windows[1])
                positions.append(torch.arange(first, first + n, device=x.device) * self.ratio)
                rows.append(seq_rows[first : first + n])
        if slot_kv:
            entries = self._entries(torch.cat(slot_kv), torch.cat(slot_score), torch.cat(positions))
            out.index_copy_(0, base + torch.cat(rows), entries)
        return all_rows

    # --- one token per sequence (decode): fixed shapes, no host data -------------------------------
    def decode(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor,
               page: int, cache: CompressorCache, out: torch.Tensor, base: int) -> None:
        """Append each sequence's token to its slot's window; every row pools its window, and rows whose
        window closes write the entry to its page row (the others to page 0, which nothing reads)."""
        r, d = self.ratio, self.dim
        kv, gate = self.ops.linear(x, self.wkv), self.ops.linear(x, self.wgate)
        flat = slots * r + positions % r
        cache.pending_kv.view(-1, self.width).index_copy_(0, flat, kv)
        cache.pending_gate.view(-1, self.width).index_copy_(0, flat, gate)
        win_kv, win_gate = cache.pending_kv[slots], cache.pending_gate[slots]  # [B, r, width]
        score = win_gate.float() + self.position_bias
        closing = (positions + 1) % r == 0
        entry = torch.clamp((positions + 1) // r - 1, min=0)  # the entry a closing window becomes
        if self.overlap:
            prev_kv, prev_gate = cache.overlap_kv[slots], cache.overlap_gate[slots]
            prev_score = prev_gate.float() + self.position_bias[:, :d]
            prev_score = torch.where((positions >= r)[:, None, None], prev_score, float("-inf"))
            shut = closing[:, None, None]
            cache.overlap_kv.index_copy_(0, slots, torch.where(shut, win_kv[..., :d], prev_kv))
            cache.overlap_gate.index_copy_(0, slots, torch.where(shut, win_gate[..., :d], prev_gate))
            win_kv = torch.cat([prev_kv, win_kv[..., d:]], dim=1)
            score = torch.cat([prev_score, score[..., d:]], dim=1)
        entries = self._entries(win_kv, score, entry * r)
        page_id = page_table.gather(1, (entry // page)[:, None])[:, 0]
        rows = torch.where(closing, base + page_id * page + entry % page, base)
        out.index_copy_(0, rows, entries)
