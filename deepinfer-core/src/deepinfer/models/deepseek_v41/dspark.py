"""The DSpark drafter of DeepSeek-V4.1 (``mtp.*``): a block of draft tokens per request in one parallel pass.

    main_x   = main_norm(main_proj(concat(target features at dspark_target_layer_ids)))   # per target position
    context  = per draft layer, wkv/kv_norm/RoPE/FP8 of main_x at positions P-W .. P-1   # :mod:`.dspark_context`
    block    = [anchor, noise x (k-1)] at positions P .. P+k-1                             # the anchor: position P
    streams  = embed(block) in hc_mult streams; draft layers = V4.1 blocks (sliding-only, own MoE), whose
               attention sees the sequence's context window and the whole block (non-causal inside the block)
    hidden   = collapse(streams, last FFN site's pre);  base logits = head(norm(hidden))
    drafts   = drawn left to right with the Markov bias of the previous token (:mod:`.dspark_heads`); sampled
               ones race the counter-based noise of (seed, s + j), s the first draft's output position

Every block position is a prediction ("anchor as first prediction": position j drafts the token at P+j+1), so a
block of k positions drafts k tokens and ``max_draft_len == dspark_block_size``.  The embedding and head are the
target's; the layers and heads are the model's (:mod:`.dspark_layers`, built as it loads), so a drafter adds
only its context.  The layers are :class:`~.layer.DecoderLayer` (tensors ``mtp.{i}.*``) with attention's
:meth:`~.attention.Attention.block` and :meth:`~.attention.Attention.latents`; the MoE, mHC and norms are the
backbone's blocks.  Implements :class:`deepinfer.spec_decode.drafter.Drafter` and its optional
:class:`~deepinfer.spec_decode.drafter.GraphDrafter` (draft passes captured per (batch bucket, k, sampled)).
"""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer.kv.pool import PooledState
from deepinfer.layers.linear import linear
from deepinfer.models.base import SequenceState
from deepinfer.models.deepseek_v41.attention import Attention
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.dspark_context import ContextRings
from deepinfer.models.deepseek_v41.dspark_heads import draw
from deepinfer.models.deepseek_v41.dspark_layers import DSparkLayers
from deepinfer.ops import Ops
from deepinfer.sample.sampler import signed64
from deepinfer.spec_decode.drafter import Drafter, DraftRequest, Drafts, GraphDrafter, VerifyExtender


class DraftTarget(Protocol):
    """What the drafter takes from its target, a loaded :class:`~.model.DeepseekV41ForCausalLM`."""

    config: DeepseekV41Config
    dspark: DSparkLayers | None
    embed: torch.Tensor
    head: torch.Tensor
    ops: Ops
    dtype: torch.dtype
    device: torch.device


class DSparkDrafter:
    """The drafter of one V4.1 model: its draft layers and heads (:class:`~.dspark_layers.DSparkLayers`, which
    the model holds and every drafter of it shares) and a context per target state, in the rows of the state's
    slot (``num_slots``: the model's state pool's)."""

    def __init__(self, cfg: DeepseekV41Config, weights: DSparkLayers, embed: torch.Tensor, head: torch.Tensor,
                 *, ops: Ops, dtype: torch.dtype, device: torch.device, num_slots: int):
        self.config, self.ops, self.dtype, self.device = cfg, ops, dtype, torch.device(device)
        self.layers, self.main_proj, self.main_norm = weights.layers, weights.main_proj, weights.main_norm
        self.norm, self.markov, self.confidence = weights.norm, weights.markov, weights.confidence
        self.embed, self.head = embed, head
        self.first_pre = torch.zeros(1, cfg.hc_mult, dtype=torch.float32, device=self.device)
        self.first_pre[0, 0] = 1.0  # as the backbone: the first layer's input is the embedding itself
        # spare ring rows: a captured verify step extends up to a block of drafts past what it keeps
        self.context = ContextRings(num_slots, len(self.layers), cfg.sliding_window, cfg.head_dim, dtype,
                                    self.device, spare=cfg.dspark_block_size)
        self.max_draft_len = cfg.dspark_block_size
        self.capture_layer_ids = cfg.dspark_target_layer_ids

    @classmethod
    def from_model(cls, model: DraftTarget, num_slots: int) -> DSparkDrafter:
        """The drafter of a loaded model (its draft layers, its embedding and head)."""
        if model.dspark is None:
            raise ValueError("this DeepSeek-V4.1 model has no DSpark drafter (num_nextn_predict_layers = "
                             f"{model.config.num_nextn_predict_layers}, or its mtp.* tensors were not read)")
        return cls(model.config, model.dspark, model.embed, model.head, ops=model.ops, dtype=model.dtype,
                   device=model.device, num_slots=num_slots)

    # --- context ---------------------------------------------------------------------------------------------
    def extend(self, states: list[SequenceState], positions: torch.Tensor, features: torch.Tensor) -> None:
        """Append target features [N, F] of rows (``states[i]``, ``positions[i]``) to the states' contexts."""
        if len(states) != features.shape[0] or positions.shape[0] != features.shape[0]:
            raise ValueError(f"extend: {len(states)} states and {positions.shape[0]} positions for "
                             f"{features.shape[0]} feature rows: one state and position per row")
        width = len(self.capture_layer_ids) * self.config.hidden_size
        if features.shape[1] != width:
            raise ValueError(f"extend: features have {features.shape[1]} columns, expected {width} "
                             f"(len(capture_layer_ids) * hidden_size)")
        slots = [self._slot(state) for state in states]
        if not slots:
            return
        self.extend_rows(torch.tensor(slots, dtype=torch.int64).to(self.device), positions.to(self.device), features)

    def extend_rows(self, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> None:
        """:meth:`extend` on the device (``slots`` / ``positions`` [N] int64 there, unchecked): no host data, so a
        captured verify step extends every row it ran (:class:`~deepinfer.spec_decode.drafter.VerifyExtender`)."""
        ops = self.ops
        main_x = ops.rms_norm(linear(ops, features.to(self.dtype), self.main_proj), self.main_norm,
                              self.config.rms_norm_eps)
        latents = [layer.attn.latents(main_x, positions) for layer in self.layers]
        self.context.write(slots, positions, latents)

    def truncate(self, state: SequenceState, length: int) -> None:
        self.context.truncate(self._slot(state), length)

    def free(self, state: SequenceState) -> None:
        """Forget ``state``'s context (a state that never held a slot has none)."""
        if not isinstance(state, PooledState) or state.slot is not None:
            self.context.free(self._slot(state))

    def fork(self, src: SequenceState, dst: SequenceState) -> None:
        """Give ``dst`` a copy of ``src``'s context (``n > 1`` forks)."""
        self.context.fork(self._slot(src), self._slot(dst))

    def _slot(self, state: SequenceState) -> int:
        """The context rows of ``state``: its pool slot, the rows its own model's steps use."""
        if not isinstance(state, PooledState):
            raise TypeError(f"the DSpark drafter follows its V4.1 model's pooled states, got {type(state).__name__}")
        if state.slot is None:
            raise ValueError("the DSpark drafter follows states that hold a slot (fed once at least); this has none")
        self.context.check_slot(state.slot)
        return state.slot

    # --- drafting ---------------------------------------------------------------------------------------------
    def draft(self, requests: list[DraftRequest], k: int) -> Drafts:
        """k drafts per request, drawn left to right; the context is not changed."""
        inputs = self.draft_inputs(requests, len(requests)).to(self.device)
        return self.draft_forward(inputs, k, any(r.temperature > 0 for r in requests))

    def draft_inputs(self, requests: list[DraftRequest], bucket: int) -> torch.Tensor:
        """Host int64 [bucket, 6]: (slot, anchor, anchor position, seed as signed 64-bit, temperature's float64
        bits, the first draft's output position) per request, then all-zero padding rows.  A padding row reads
        slot 0 at position 0, where no context row is valid (it holds positions < 0 only), so it attends to its
        own block alone, and drafts greedily (temperature 0.0) (:class:`deepinfer.spec_decode.drafter.GraphDrafter`)."""
        if bucket < len(requests):
            raise ValueError(f"draft_inputs: {len(requests)} requests do not fit a bucket of {bucket} rows")
        slots = [self._slot(r.state) for r in requests]
        temps = torch.tensor([float(r.temperature) for r in requests] + [0.0] * (bucket - len(requests)),
                             dtype=torch.float64)
        rows = [[slot, r.anchor, r.position, signed64(r.seed), 0, r.step]
                for slot, r in zip(slots, requests, strict=True)]
        inputs = torch.tensor(rows + [[0] * 6] * (bucket - len(requests)), dtype=torch.int64).view(bucket, 6)
        inputs[:, 4] = temps.view(torch.int64)
        return inputs

    def draft_forward(self, inputs: torch.Tensor, k: int, sampled: bool) -> Drafts:
        """The drafts of ``draft_inputs`` rows on the device: fixed shapes, no host data, so the runner can capture
        it per (bucket, k, sampled).  Without ``sampled`` every row drafts greedily."""
        self._check_k(k)
        return self._drafts(inputs, k, sampled)

    def block(self, requests: list[DraftRequest], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The parallel pass: (hidden before the final norm [B, k, D], base logits [B, k, V] fp32)."""
        return self._block(self.draft_inputs(requests, len(requests)).to(self.device), k)

    def _check_k(self, k: int) -> None:
        if not 1 <= k <= self.max_draft_len:
            raise ValueError(f"k must be in [1, {self.max_draft_len}] (dspark_block_size), got {k}")

    def _drafts(self, inputs: torch.Tensor, k: int, sampled: bool) -> Drafts:
        """The parallel pass over ``inputs`` [B, 6] (device), then the k drafts drawn left to right: argmax only
        unless ``sampled``; then rows with a temperature draw draft ``j`` by the race over the noise of (seed,
        s + j), s the first draft's output position: the verifier's noise there (``deepinfer.ops.speculative``)."""
        hidden, logits = self._block(inputs, k)
        prev = inputs[:, 1].contiguous()
        seeds, steps = inputs[:, 3].contiguous(), inputs[:, 5]
        temps = inputs[:, 4].contiguous().view(torch.float64).float()
        tokens, confidence = [], []
        for j in range(k):
            code, bias = self.markov(prev)
            confidence.append(self.confidence(hidden[:, j], code))
            biased = logits[:, j] + bias
            prev = draw(self.ops, biased, temps, seeds, steps + j) if sampled else biased.argmax(dim=-1)
            tokens.append(prev)
        return Drafts(torch.stack(tokens, dim=1), torch.stack(confidence, dim=1))

    def _block(self, inputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`block` of ``draft_inputs`` rows [B, 6] on the device."""
        ops, cfg, b = self.ops, self.config, inputs.shape[0]
        slots, anchors, starts = inputs[:, 0], inputs[:, 1], inputs[:, 2]
        ids = torch.full((b, k), cfg.dspark_noise_token_id, dtype=torch.int64, device=self.device)
        ids[:, 0] = anchors
        ids = ids.flatten()
        offsets = torch.arange(k, device=self.device)
        positions = (starts[:, None] + offsets).flatten()
        contexts, valid = self.context.window_of(slots, starts)
        cols = self._columns(valid, k)

        def attend(attn: Attention, x: torch.Tensor, i: int) -> torch.Tensor:
            return attn.block(x, positions, contexts[i], cols)

        x = ops.embedding(ids, self.embed)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = self.first_pre.expand(ids.shape[0], -1)
        for i, layer in enumerate(self.layers):
            streams, pre = layer(streams, pre, ids, None, attend, i)
        hidden = ops.hc_collapse(streams, pre)
        logits = ops.linear(ops.rms_norm(hidden, self.norm, cfg.rms_norm_eps), self.head).float()
        return hidden.view(b, k, -1), logits.view(b, k, -1)

    def _columns(self, valid: torch.Tensor, k: int) -> torch.Tensor:
        """[B * k, R + k] columns into ``cat(context rows [B * R], block latents [B * k])``: each block row sees
        its sequence's valid context rows and every row of its own block."""
        b, w = valid.shape
        seq = torch.arange(b, device=valid.device)[:, None]
        context = torch.where(valid, seq * w + torch.arange(w, device=valid.device), -1)
        own = b * w + seq * k + torch.arange(k, device=valid.device)
        row = torch.cat([context, own], dim=1)  # [B, W + k]
        return row[:, None, :].expand(b, k, w + k).reshape(b * k, w + k)


def _implements_the_protocol(drafter: DSparkDrafter) -> Drafter:
    """Never called: mypy checks here that :class:`DSparkDrafter` is a :class:`Drafter`."""
    return drafter


def _implements_graph_drafting(drafter: DSparkDrafter) -> GraphDrafter:
    """Never called: mypy checks that :class:`DSparkDrafter` is a :class:`GraphDrafter`."""
    return drafter


def _implements_verify_extension(drafter: DSparkDrafter) -> VerifyExtender:
    """Never called: mypy checks that :class:`DSparkDrafter` is a :class:`VerifyExtender`."""
    return drafter
