"""DeepSeek-V4.1 as a causal LM over the op table.

    streams = [embed(tokens)] * hc_mult;  pre = one-hot(stream 0)        # single-pass mHC
    for each layer:
        streams = engram(streams, n-grams)                   # Engram layers only
        x, pre', post, comb = hc_pre(streams, pre)           # collapse with the previous site's pre
        streams = hc_post(attention(RMSNorm(x)), streams, post, comb)
        x, pre, post, comb = hc_pre(streams, pre')
        streams = hc_post(moe(RMSNorm(x)), streams, post, comb)
    hidden = RMSNorm(collapse(streams, pre));  logits = head(hidden)

Attention is the causal encoder-decoder of CSA2 groups (see :mod:`.attention`, :mod:`.state`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.kv.decode_plan import DecodePlan, DecodeStep, RatioKinds
from deepinfer.kv.layout import BuiltOnUse, RaggedLayout
from deepinfer.kv.pool import PooledState, StatePool
from deepinfer.layers.linear import dense_getter, stored_weight
from deepinfer.models.base import ForwardBatch
from deepinfer.models.deepseek_v41.attention import Attention, GraphStep, RaggedStep
from deepinfer.models.deepseek_v41.capture import Capture
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.dspark import DSparkDrafter
from deepinfer.models.deepseek_v41.dspark_layers import DSparkLayers
from deepinfer.models.deepseek_v41.engram import Engram
from deepinfer.models.deepseek_v41.engram_hash import EngramLayout, engram_lookback, history_after
from deepinfer.models.deepseek_v41.engram_shard import shard_engrams
from deepinfer.models.deepseek_v41.indexer import Published
from deepinfer.models.deepseek_v41.layer import Attend, DecoderLayer, build_layers
from deepinfer.models.deepseek_v41.state import Views, state_spec, views_for
from deepinfer.models.deepseek_v41.truncation import DecoderRows, cut_layer, decoder_rows
from deepinfer.models.deepseek_v41.verify_step import VerifyRecord, commit
from deepinfer.models.pooled import PooledCausalLM, verify_step
from deepinfer.models.weight_reader import Stored
from deepinfer.ops import Ops
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.context_parallel import context_split, run_split
from deepinfer.spec_decode.drafter import Drafter


class DeepseekV41ForCausalLM(PooledCausalLM):
    """Implements :class:`deepinfer.models.base.CausalLM` and :class:`~deepinfer.models.base.GraphDecodable`.

    ``token_map``: the Engram compressed id of every token id ([vocab] int64), derived from the tokenizer.
    ``decoder_keep``: decoder prefill truncation (:mod:`.truncation`): the decoder runs on the last
    ``decoder_keep`` positions of a prompt; None: on every position.
    Quantized checkpoint tensors are dequantized into the compute dtype (no stored copy is kept), except Engram
    tables (gathered by row) and, with ``native_weights``, FP8 projections and MXFP4 / FP8 routed experts (kept as
    stored, run by the quantized GEMM ops); the DSpark drafter's tensors (``mtp``, empty when not read) become
    its layers (:attr:`dspark`) for :meth:`make_drafter`, in the same form.  ``tensors`` is consumed: a layer's
    entries are dropped once it is built (it keeps what it runs, its stacks in place of the stored parts), so a
    load never holds more than one layer's weights twice (pass a copy to build two models from one dict).
    ``quantized_kv``: the state stores K=V and indexer keys in the model's formats (:mod:`.state`).
    ``parallel``: this rank's parallel context (expert-parallel MoE layers); None: one process.
    """

    def __init__(self, cfg: DeepseekV41Config, tensors: dict[str, Stored], mtp: dict[str, Stored],
                 token_map: torch.Tensor | None, *, ops: Ops, dtype: torch.dtype, device: torch.device,
                 decoder_keep: int | None = None, parallel: ParallelContext | None = None,
                 native_weights: bool = False, quantized_kv: bool = False):
        self.config, self.ops, self.dtype, self.device = cfg, ops, dtype, torch.device(device)
        self.vocab_size = cfg.vocab_size
        get = dense_getter(tensors, ops, dtype)
        weight = stored_weight(tensors, get) if native_weights else None
        self.embed = get("embed.weight")
        self.head = self.embed if cfg.tie_word_embeddings else get("head.weight")
        self.norm = get("norm.weight")
        engrams: dict[int, Engram] = {}
        if cfg.engram_layer_ids:
            if token_map is None:
                raise ValueError("DeepSeek-V4.1 with Engram layers needs the tokenizer's compressed token map")
            layout = EngramLayout.from_config(cfg)
            self.token_map = token_map.to(self.device)
            self.pad_id = int(self.token_map[cfg.engram_pad_id])
            engrams = {layer: Engram(ops, layout, i, get, tensors.__getitem__, cfg.rms_norm_eps, weight)
                       for i, layer in enumerate(cfg.engram_layer_ids)}
            shard_engrams(parallel, engrams, cfg.engram_layer_ids, cfg.engram_num_embeddings)
        self.layers = build_layers(tensors, "layers.", cfg.num_hidden_layers, lambda i: DecoderLayer(
            ops, cfg, cfg.layers[i], get, engrams.get(i), parallel=parallel, weight=weight))
        self.parallel = parallel
        #: The DSpark drafter's layers and heads; None when the checkpoint has none or they were not read.
        self.dspark = DSparkLayers(cfg, mtp, ops=ops, dtype=dtype) if mtp and cfg.num_nextn_predict_layers else None
        self.first_pre = torch.zeros(1, cfg.hc_mult, dtype=torch.float32, device=self.device)
        self.first_pre[0, 0] = 1.0  # layer 0 collapses with a one-hot pre: its input is the embedding itself
        self.state_spec, self.views = state_spec(cfg, quantized=quantized_kv), views_for(cfg, ops)
        self.ratio_kinds = {r: RatioKinds(indexed=True) for r in self.state_spec.paged_ratios}
        self.decoder_keep = decoder_keep
        self.decoder_layer = cut_layer(cfg, decoder_keep) if decoder_keep is not None else None
        #: Layers whose outputs a batch with ``capture_rows`` gets back (:mod:`.capture`): the drafter's targets.
        self.capture_layer_ids: tuple[int, ...] = cfg.dspark_target_layer_ids
        self._capture: Capture | None = None  # set for the duration of one capturing forward

    @property
    def _history_lookback(self) -> int:  # type: ignore[override]
        return self.config.engram_max_ngram_size if self.config.engram_layer_ids else 0

    def replay_start(self, hit: int, needed: int) -> int:
        """With decoder prefill truncation the decoder runs from ``needed + 1 - decoder_keep`` on: the layers
        below it must be exact from there too, so the replay reaches back from the earlier of that and ``hit``."""
        if self.decoder_keep is None:
            return super().replay_start(hit, needed)
        return max(0, min(hit, needed + 1 - self.decoder_keep) - self.replay_lookback)

    def make_drafter(self) -> Drafter | None:
        """The checkpoint's DSpark drafter over the configured state pool (one context per pool slot), or None
        when the checkpoint has none (:class:`deepinfer.spec_decode.drafter.DraftingModel`)."""
        if self.dspark is None:
            return None
        if self.pool is None or self.pool.growable:
            raise RuntimeError("make_drafter: configure_state first (the drafter keeps a context per state slot)")
        return DSparkDrafter.from_model(self, self.pool.slots)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """:meth:`PooledCausalLM.forward`; with ``batch.capture_rows`` also sets ``batch.captured``."""
        if batch.capture_rows is None:
            return super().forward(batch)
        self._capture = Capture.request(self.capture_layer_ids, batch.capture_rows, batch.input_ids.shape[0],
                                        self.config.hc_mult)
        try:
            hidden = super().forward(batch)
            batch.captured = self._capture.result()
        finally:
            self._capture = None
        return hidden

    def _ragged(self, batch: ForwardBatch, layout: RaggedLayout, states: list[PooledState], pool: StatePool
                ) -> torch.Tensor:
        step = RaggedStep(batch.positions, layout, states, Published())
        views: Views = pool.views
        lookback = None
        if views.history is not None:
            slots = [s.slot for s in states]
            seq_info = batch.upload(torch.tensor([slots, layout.starts], dtype=torch.int64))[:, layout.seq_ids]
            lookback = engram_lookback(self.token_map[batch.input_ids], batch.positions, seq_info[1],
                                       views.history[seq_info[0]], self.pad_id)
            last = torch.tensor([o + n - 1 for o, n in zip(layout.offsets, layout.lens, strict=True)])
            views.history.index_copy_(0, batch.upload(torch.tensor(slots, dtype=torch.int64)),
                                      history_after(lookback, batch.upload(last)))

        def attend(attn: Attention, x: torch.Tensor, i: int) -> torch.Tensor:
            return attn(x, step, views.layers[i])

        cut = None
        if self.decoder_keep is not None:
            cut = decoder_rows(batch, layout, states, pool, self.decoder_keep)
        # context parallelism: this rank's rows (not under truncation, nor when the drafter captures every row)
        split = context_split(self.parallel, batch.seq_lens, self.device) if cut is None and self._capture is None \
            else None
        if split is not None:
            return run_split(self._run, split, layout, batch.input_ids, attend, lookback)
        if cut is None:
            return self._run(batch.input_ids, lookback, attend)
        return self._run_truncated(batch.input_ids, lookback, attend, step, cut, views)

    def _run_truncated(self, input_ids: torch.Tensor, lookback: torch.Tensor | None, attend: Attend,
                       step: RaggedStep, cut: DecoderRows, views: Views) -> torch.Tensor:
        """:meth:`_run` with the decoder on ``cut``'s rows only; the other rows' hidden states are zeros."""
        assert self.decoder_layer is not None
        streams, pre = self._embed(input_ids)
        for i, layer in enumerate(self.layers[: self.decoder_layer]):
            streams, pre = layer(streams, pre, input_ids, lookback, attend, i)
            self._take(i, streams)
        split = self.layers[self.decoder_layer]
        site = split.attention_input(streams, pre, lookback)
        split.attn.compress(site.x, step, views.layers[self.decoder_layer])  # the global KV of every row
        hidden = torch.zeros(input_ids.shape[0], site.x.shape[1], dtype=site.x.dtype, device=site.x.device)
        if not cut.states:  # no row of this step is kept (an early chunk of a long prompt)
            for i in range(self.decoder_layer, len(self.layers)):
                self._take(i, streams[:0], cut.rows)
                layer = self.layers[i]  # expert parallelism: the other ranks still exchange these layers' tokens
                if i > self.decoder_layer and layer.engram is not None:  # (the split layer's Engram ran above)
                    layer.engram.idle()
                layer.ffn.idle()
            return hidden
        rows, kept = cut.rows, RaggedStep(cut.positions, cut.layout, cut.states, Published(), precompressed=True)

        def attend_kept(attn: Attention, x: torch.Tensor, i: int) -> torch.Tensor:
            return attn(x, kept, views.layers[i])

        input_ids, lookback = input_ids[rows], (lookback[rows] if lookback is not None else None)
        streams, pre = split.finish(site.rows(rows), input_ids, attend_kept, self.decoder_layer)
        self._take(self.decoder_layer, streams, rows)
        for i, layer in enumerate(self.layers[self.decoder_layer + 1 :], self.decoder_layer + 1):
            streams, pre = layer(streams, pre, input_ids, lookback, attend_kept, i)
            self._take(i, streams, rows)
        return hidden.index_copy_(0, rows, self._final(streams, pre))

    # --- verify steps (runner/verify_graphs.py): each sequence's anchor and drafts, fixed shapes ----------------
    def verify_inputs(self, states: list[PooledState], anchors: list[int], bucket: int, q: int,
                      max_tokens: int) -> dict[str, torch.Tensor]:
        """Host tensors of a verify step of ``q`` rows a sequence (:func:`~deepinfer.models.pooled.verify_step`)
        padded to ``bucket`` sequences, for :meth:`verify_forward` on static buffers."""
        assert self.pool is not None, "verify_inputs: the model has no configured state pool"
        if not 1 <= q <= self.max_verify_rows:
            raise ValueError(f"verify_inputs: q = {q} rows a sequence, the state's rings take 1 .. "
                             f"{self.max_verify_rows}")
        return verify_step(states, self.pool, anchors, bucket, q, max_tokens).tensors()

    def verify_forward(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, VerifyRecord]:
        """(hidden [T, hidden], the drafter's target features [T, F], the record :meth:`commit_verify` reads) of
        a verify step on the device: fixed shapes and no host data, so it can be captured and replayed."""
        assert self.pool is not None, "verify_forward: the model has no configured state pool"
        step = DecodeStep.from_tensors(tensors)
        rows = step.input_ids.shape[0]
        if self.capture_layer_ids:
            self._capture = Capture.request(self.capture_layer_ids, torch.arange(rows, device=step.input_ids.device),
                                            rows, self.config.hc_mult)
        record = VerifyRecord()
        try:
            hidden = self._decode(step, self.pool, record)
            features = self._capture.result() if self._capture is not None else hidden.new_zeros(rows, 0)
        finally:
            self._capture = None
        return hidden, features, record

    @property
    def max_verify_rows(self) -> int:
        """The most rows a sequence a verify step takes: its ring's spare rows and the anchor."""
        return self.pool.spec.ring_spare + 1 if self.pool is not None else 1

    def commit_verify(self, record: VerifyRecord, states: list[PooledState], kept: torch.Tensor, q: int,
                      upload: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[list[int]], None]:
        """Queue what keeping the first ``kept[i]`` rows of sequence ``i`` of the verify step ``record`` came from
        leaves (:func:`~.verify_step.commit`; ``kept`` on the device); the returned function advances the states
        once the host holds the counts: they then hold exactly those tokens."""
        assert self.pool is not None
        return commit(record, self.pool.views.history, states, kept, q, upload)

    def _decode(self, step: DecodeStep, pool: StatePool, record: VerifyRecord | None = None) -> torch.Tensor:
        """A decode step, or with ``record`` a verify step (``step.starts``), whose carry-over is left to the
        commit."""
        spec, views = pool.spec, pool.views
        bases = {r: pool.entry_base(r) for r in pool.ratios}
        plan = DecodePlan.build(step, spec.window, spec.page_size, bases, self.config.index_topk, self.ratio_kinds,
                                spec.ring)
        window_cols = BuiltOnUse(lambda base: torch.where(plan.window_cols >= 0, plan.window_cols + base, -1))
        window_cols[0] = plan.window_cols
        graph = GraphStep(step, plan, window_cols, Published(), record)
        lookback = None
        if views.history is not None:
            starts = step.starts if step.starts is not None else step.positions
            lookback = engram_lookback(self.token_map[step.input_ids], step.positions, starts,
                                       views.history[step.slots], self.pad_id)
            if record is None:
                views.history.index_copy_(0, step.slots, history_after(lookback, plan.seq_ids))
            else:
                record.lookback = lookback

        def attend(attn: Attention, x: torch.Tensor, i: int) -> torch.Tensor:
            return attn.decode(x, graph, views.layers[i], bases.get(attn.ratio, 0))

        return self._run(step.input_ids, lookback, attend)

    def _run(self, input_ids: torch.Tensor, lookback: torch.Tensor | None, attend: Attend) -> torch.Tensor:
        streams, pre = self._embed(input_ids)
        for i, layer in enumerate(self.layers):
            streams, pre = layer(streams, pre, input_ids, lookback, attend, i)
            self._take(i, streams)
        return self._final(streams, pre)

    def _take(self, layer: int, streams: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        if self._capture is not None:
            self._capture.take(self.ops, layer, streams, kept)

    def _embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding copied into every stream, and the first site's one-hot pre."""
        x = self.ops.embedding(input_ids, self.embed)
        return x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous(), self.first_pre.expand(x.shape[0], -1)

    def _final(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The streams collapsed with the last site's pre, normalised: the hidden states."""
        return self.ops.rms_norm(self.ops.hc_collapse(streams, pre), self.norm, self.config.rms_norm_eps)

