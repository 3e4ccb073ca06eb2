"""V4.1 attention: shared K=V multi-query attention over a private sliding window plus the group's entries.

- queries: ``q = wq_b(RMSNorm(wq_a x))`` rotated on the last rope dims (no per-head norm, unlike V4);
- one K=V latent per token: ``RMSNorm(wkv x)`` rotated, then FP8 (ue8m0 scale per 32): the model's own
  fake-quantization, so the ring stores exactly what is attended (packed in that format with
  ``DEEPINFER_QUANTIZED_KV``: :mod:`.state`, :mod:`deepinfer.kv.store`; decode then attends to the packed rows in
  place, ``sparse_attention_packed_inverse_rope``);
- keys = the layer's last ``sliding_window`` latents and, in layers with a ratio, the top-k entries of its
  group (CSA2 roles: the kv source compresses, index sources pick, Reuse layers take the latest picks);
- a sink logit per head; the output's rope dims rotated back; grouped output projection ``wo_a`` / ``wo_b``.
Layers with a ratio (ratio 1 included) rotate with the ``compress`` RoPE family, sliding-only layers with ``main``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.kv.decode_plan import CausalPicks, DecodePlan, DecodeStep
from deepinfer.kv.layout import RaggedLayout
from deepinfer.kv.pool import PooledState
from deepinfer.kv.store import PackedRows, PagedRows, RowStore
from deepinfer.layers.linear import GetWeight, Projection, grouped_linear, linear
from deepinfer.models.deepseek_v41.compressor import Compressor
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.indexer import Indexer, IndexerSpec, Published
from deepinfer.models.deepseek_v41.roles import FULL, REUSE, LayerRole
from deepinfer.models.deepseek_v41.state import LayerCache
from deepinfer.models.deepseek_v41.verify_step import VerifyRecord
from deepinfer.models.rope import inv_freq
from deepinfer.ops import Ops
from deepinfer.ops.fake_quant import ScaleFormat

#: The compressed latent's FP4 format (block, scale format) and the sliding window's FP8 block.
LATENT_FORMAT: tuple[int, ScaleFormat] = (16, "e4m3")
WINDOW_BLOCK = 32


@dataclass(slots=True)
class RaggedStep:
    """One ragged step as every layer sees it."""

    positions: torch.Tensor  # [T]
    layout: RaggedLayout
    states: list[PooledState]
    published: Published
    #: The kv source already compressed this step's rows (a truncated prefill: it compressed all rows, the
    #: decoder runs on the last ones)
    precompressed: bool = False


@dataclass(slots=True)
class GraphStep:
    """One decode step (fixed shapes) as every layer sees it; ``window_cols[base]``: the plan's window columns
    for a ring at row ``base`` of its KV buffer."""

    step: DecodeStep
    plan: DecodePlan
    window_cols: dict[int, torch.Tensor]
    published: Published
    record: VerifyRecord | None = None  # a verify step's (``step.starts`` set): what its commit needs


def _keys(store: RowStore, rows: torch.Tensor) -> torch.Tensor | PagedRows:
    """The indexer keys of entry rows ``rows``: read in place by the indexer where they are packed, else values."""
    paged = store.in_place(rows)
    return paged if paged is not None else store.read(rows)


class Attention:
    def __init__(self, ops: Ops, cfg: DeepseekV41Config, role: LayerRole, get: Callable[[str], torch.Tensor],
                 prefix: str | None = None, weight: GetWeight | None = None):
        """``prefix``: the tensors' name prefix (default ``layers.N.attn.``; the DSpark drafter's ``mtp.i.attn.``);
        ``weight``: the projections' weights as the model keeps them (FP8 where it keeps them quantized); None:
        ``get``."""
        weight = weight or get
        p = prefix if prefix is not None else f"layers.{role.layer_id}.attn."
        self.ops, self.role, self.ratio = ops, role, role.ratio
        self.heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.eps = cfg.rms_norm_eps
        spec = cfg.rope_main if role.rope == "main" else cfg.rope_compress
        self.kv_norm = get(p + "kv_norm.weight")
        self.inv_freq = inv_freq(spec, cfg.rope_dim).to(self.kv_norm.device)
        self.rope_scaling = spec.attention_scaling
        self.q_norm, self.wq_b = get(p + "q_norm.weight"), weight(p + "wq_b.weight")
        self.wo_a, self.wo_b, self.sinks = weight(p + "wo_a.weight"), weight(p + "wo_b.weight"), get(p + "attn_sink")
        names = ["wq_a", "wkv"]
        self.compressor = self.indexer = None
        if role.mode == FULL:
            self.compressor = Compressor(ops, get, p + "compressor.", ratio=role.ratio, eps=cfg.rms_norm_eps)
        if role.is_index_source:
            rope = cfg.rope_compress
            index_freq = inv_freq(rope, cfg.rope_dim).to(self.inv_freq.device)
            ispec = IndexerSpec(cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.candidate_block_size,
                                cfg.candidate_topk_blocks, cfg.rms_norm_eps)
            self.indexer = Indexer(ops, ispec, role, get, p + "indexer.", index_freq, rope.attention_scaling, weight)
            names.append("indexer.weights_proj")
        # what the layer projects the token itself to, as one GEMM: wq_a | wkv (| indexer head weights)
        self.w_in = Projection([weight(p + name + ".weight") for name in names])
        self.in_splits = self.w_in.sizes
        # wkv alone (the DSpark drafter's context latents): a view of w_in's rows, never a second copy
        self.wkv = self.w_in.part(1)

    # --- shared by both paths -------------------------------------------------------------------------
    def _project(self, x: torch.Tensor, positions: torch.Tensor, ring: RowStore | None = None,
                 values: bool = True):
        """(q_residual, rotated queries [T, H, Dh], the K=V latent [T, Dh] (rotated, FP8), its rows as ``ring``
        stores them, index head weights).  ``values=False``: the caller reads only the stored rows (decode), so a
        packed ring's rows are not unpacked (the latent is then the stored rows)."""
        ops, tokens = self.ops, x.shape[0]
        q_lin, kv_lin, *rest = self.w_in(ops, x).split(self.in_splits, dim=1)
        q_residual = ops.rms_norm(q_lin, self.q_norm, self.eps)
        q = linear(ops, q_residual, self.wq_b).view(tokens, self.heads, self.head_dim)
        q = ops.rope(q, positions, self.inv_freq, self.rope_scaling)
        if ring is not None and ring.packed:  # the ring stores FP8 codes: pack the rotated latent itself
            latent = ops.rms_norm_rope(kv_lin, self.kv_norm, self.eps, positions, self.inv_freq, self.rope_scaling)
            if values:
                stored, kv = ring.encode(latent)
            else:
                stored = kv = ring.stored(latent)
        else:
            kv = stored = ops.rms_norm_rope_fp8_e4m3_fake_quant(kv_lin, self.kv_norm, self.eps, positions,
                                                                self.inv_freq, self.rope_scaling, WINDOW_BLOCK)
        return q_residual, q, kv, stored, (rest[0] if rest else None)

    def latents(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The K=V latents [T, Dh] of rows ``x`` alone (rotated, FP8): the DSpark drafter's context, projected
        from its main feature by each draft layer's own ``wkv`` / ``kv_norm``."""
        return self.ops.rms_norm_rope_fp8_e4m3_fake_quant(linear(self.ops, x, self.wkv), self.kv_norm, self.eps,
                                                          positions, self.inv_freq, self.rope_scaling, WINDOW_BLOCK)

    def _entries(self, latents: torch.Tensor, positions: torch.Tensor, pages: RowStore) -> torch.Tensor:
        """Compressed entries of pre-RoPE latents at their windows' first positions, rotated, then FP4, as the
        entry ``pages`` store them (packed, or fake-quantized values)."""
        if pages.packed:
            return pages.stored(self.ops.rope(latents, positions, self.inv_freq, self.rope_scaling))
        return self.ops.rope_fp4_e2m1_fake_quant(latents, positions, self.inv_freq, self.rope_scaling, *LATENT_FORMAT)

    def _output(self, q: torch.Tensor, pool: torch.Tensor, cols: torch.Tensor, positions: torch.Tensor):
        """``pool``: values (rows read from the state, or the state's own tensor)."""
        out = self.ops.sparse_attention_inverse_rope(q, pool, cols, self.sinks, self.head_dim**-0.5, positions,
                                                     self.inv_freq, self.rope_scaling)
        return self._project_out(out)

    def _output_packed(self, q: torch.Tensor, rows: PackedRows, cols: torch.Tensor, positions: torch.Tensor):
        """Attention over the state's packed rows in place (``cols`` in the buffer's joint numbering)."""
        entry = rows.entry_format
        out = self.ops.sparse_attention_packed_inverse_rope(
            q, rows.rings, rows.entries, rows.entry_base, cols, self.sinks, self.head_dim**-0.5, positions,
            self.inv_freq, self.rope_scaling, rows.ring_format.block, entry.block,
            "e4m3" if entry.scale_format == "e4m3" else "ue8m0")
        return self._project_out(out)

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        ops, tokens = self.ops, out.shape[0]
        out = grouped_linear(ops, out.view(tokens, self.groups, -1), self.wo_a).flatten(1)
        return linear(ops, out, self.wo_b)

    def _picks(self, q_residual, weights, positions, keys, seq_ids, causal: CausalPicks | None,
               published: Published, longest: int) -> torch.Tensor | None:
        """This layer's picks (its own or its index source's); None: every causal entry."""
        group = self.role.kv_source
        assert group is not None  # a layer with a ratio belongs to a group
        if self.role.mode == REUSE:
            return published.picks[group]
        assert self.indexer is not None
        if longest <= self.indexer.spec.topk:  # no sequence has more entries than are picked
            ids = None
        else:
            if causal is None:
                counting = torch.arange(self.indexer.spec.topk, device=positions.device)
                causal = CausalPicks.build((positions + 1) // self.ratio, counting)
            ids = self.indexer.picks(q_residual, weights, positions, keys, seq_ids, causal, published)
        published.picks[group] = ids
        return ids

    # --- any chunk lengths ----------------------------------------------------------------------------
    def compress(self, x: torch.Tensor, step: RaggedStep, cache: LayerCache) -> None:
        """A kv source: the entries and indexer keys of the windows the step closes, to the group's pages."""
        if self.compressor is None:
            return
        latents = self.compressor.ragged(x, step.layout, step.states, cache.pending)
        if latents is not None:
            plan = step.layout.plans[self.ratio]
            closed = plan.closed_positions
            assert closed is not None and plan.closed_kv_rows is not None and plan.closed_rows is not None
            cache.kv_rows.write_entries(plan.closed_rows, self._entries(latents, closed, cache.kv_rows.entries))
            assert self.indexer is not None and cache.key_rows is not None
            cache.key_rows.write(plan.closed_rows, self.indexer.keys(latents, closed, cache.key_rows))

    def __call__(self, x: torch.Tensor, step: RaggedStep, cache: LayerCache) -> torch.Tensor:
        """The step's attention pool is the sequences' window history and the group's entries gathered from the
        layer's KV buffer, then the new latents (``layout.plans``: where); then the ring takes its newest."""
        positions, layout = step.positions, step.layout
        q_residual, q, kv, stored, weights = self._project(x, positions, cache.kv_rows.rings)
        plan = layout.plans[self.ratio]
        if not step.precompressed:  # first: the step's closed windows are entries the pool gathers
            self.compress(x, step, cache)
        cols = plan.window_cols
        if self.ratio:
            longest = max((s + n) // self.ratio for s, n in zip(layout.starts, layout.lens, strict=True))
            keys: torch.Tensor | PagedRows | None = None
            if self.indexer is not None and longest > self.indexer.spec.topk:
                assert cache.key_rows is not None
                keys = _keys(cache.key_rows, layout.entry_rows[self.ratio][:, :longest])
            picks = self._picks(q_residual, weights, positions, keys, layout.seq_ids, None, step.published, longest)
            assert plan.causal_cols is not None and plan.entry_offsets is not None  # a compressed ratio's plan
            if picks is None:
                cols = plan.causal_cols
            else:
                cols = torch.cat([cols, torch.where(picks >= 0, plan.entry_offsets[:, None] + picks, -1)], dim=1)
        gather_rows, ring_rows = plan.for_ring(cache.ring_base)
        keys_pool = torch.cat([cache.kv_rows.read(gather_rows), kv])
        cache.kv_rows.write_rings(ring_rows, stored[plan.ring_src])  # after the gather: it read the old rings
        if (rows := layout.query_rows) is not None:  # context parallelism: this rank's queries only
            q, cols, positions = q[rows], cols[rows], positions[rows]
        return self._output(q, keys_pool, cols, positions)

    # --- a DSpark draft block: non-causal, over precomputed context latents -----------------------
    def block(self, x: torch.Tensor, positions: torch.Tensor, context: torch.Tensor, cols: torch.Tensor
              ) -> torch.Tensor:
        """Attention of draft-block rows ``x`` [T, D] at ``positions``: the keys are ``context`` [C, Dh] (latents
        from :meth:`latents`) followed by the block's own latents; ``cols`` [T, K] index that concatenation
        (``-1``: unused), so the caller decides who sees whom (the drafter: every row sees its block and its
        sequence's context window).  No state is written."""
        _, q, kv, _, _ = self._project(x, positions)
        return self._output(q, torch.cat([context, kv]), cols, positions)

    # --- one token per sequence (decode): fixed shapes, no host data -------------------------------
    def decode(self, x: torch.Tensor, graph: GraphStep, cache: LayerCache, entry_base: int) -> torch.Tensor:
        """The token's latent goes to its ring first (which then holds exactly the window ending at it; in a verify
        step every row's, the ring's spare rows keep what the earlier rows read); the window and the group's entry
        pages are read in place through row indices (``graph.plan``)."""
        step, plan = graph.step, graph.plan
        q_residual, q, _, stored, weights = self._project(x, step.positions, cache.kv_rows.rings, values=False)
        cache.kv_rows.write_rings(plan.ring_rows + cache.ring_base, stored)
        cols = graph.window_cols[cache.ring_base]
        if self.ratio:
            ratio = plan.ratios[self.ratio]
            if self.compressor is not None:
                latents = self.compressor.decode(x, step.slots, ratio, cache.pending, graph.record)
                entries = self._entries(latents, ratio.entry_positions, cache.kv_rows.entries)
                cache.kv_rows.write_entries(ratio.entry_write, entries)
                assert self.indexer is not None and cache.key_rows is not None
                new_keys = self.indexer.keys(latents, ratio.entry_positions, cache.key_rows)
                cache.key_rows.write(ratio.entry_write, new_keys)
            keys: torch.Tensor | PagedRows | None = None
            if ratio.picks is not None and self.indexer is not None:
                assert cache.key_rows is not None
                keys = _keys(cache.key_rows, ratio.entry_rows)
            longest = ratio.entry_rows.shape[1] if ratio.picks is not None else 0
            picks = self._picks(q_residual, weights, step.positions, keys, plan.seq_ids, ratio.picks,
                                graph.published, longest)
            if picks is None:
                assert ratio.causal_entries is not None
                cols = torch.cat([cols, ratio.causal_entries], dim=1)
            else:
                assert ratio.pick_cols is not None
                cols = torch.cat([cols, ratio.pick_cols[plan.seq_ids[:, None], picks]], dim=1)
        packed = cache.kv_rows.packed_rows()
        if packed is not None:  # the packed rows are read in place: no unpacked copy of the attended rows
            return self._output_packed(q, packed, cols, step.positions)
        pool, cols = cache.kv_rows.attention_pool(cols)
        return self._output(q, pool, cols, step.positions)
