"""Decoder prefill truncation (``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact``): SWA bounded replay of V4.1's
causal encoder-decoder.

The decoder's global KV (the compressed entries and indexer keys of its kv source, one per token) must exist for
every prompt position, but the decoder's own outputs are read only near the end of the prompt: its private
sliding windows reach back ``sliding_window`` tokens from each later token.  So a prompt's decoder runs only on its
last ``KEEP`` positions: the kv source compresses every row, then that layer's attention and FFN and every later
layer run on the kept rows, each reading its window only from the first kept position on (the *floor*).  Global KV
is exact; the kept rows' stacked SWA attention differs from a full prefill (their windows start at the floor).

The floor of a sequence is ``needed + 1 - KEEP``, where ``needed`` is the first position whose output the engine
reads (:attr:`~deepinfer.models.base.ForwardBatch.needed_from`: the last prompt token, or position 0 when prompt
logprobs are asked for, which gives the full prefill), so a prompt split into chunks keeps the same rows as one
fed whole.  KEEP must cover the window and the drafter's look-back: decoding starts at the floor + KEEP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kv.layout import BuiltOnUse, RaggedLayout
from deepinfer.kv.pool import PooledState, StatePool
from deepinfer.kv.ragged_plan import prefill_plan
from deepinfer.models.base import ForwardBatch
from deepinfer.models.deepseek_v41.config import DeepseekV41Config

ENV_KEEP = "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"


def drafter_lookback(cfg: DeepseekV41Config) -> int:
    """Positions before the decode start a speculative step may read beyond the window: twice the verify width
    (an anchor and ``dspark_block_size`` drafts); 0 without a drafter.  With the released window 128 and block 5
    the bound is 128 + 12 = 140, the default KEEP."""
    return 2 * (cfg.dspark_block_size + 1) if cfg.num_nextn_predict_layers else 0


def cut_layer(cfg: DeepseekV41Config, keep: int) -> int:
    """The layer the decoder starts at (its kv source, of ratio 1); raises for a KEEP below the bound or a model
    without a ratio-1 decoder."""
    bound = cfg.sliding_window + drafter_lookback(cfg)
    if keep < bound:
        raise ValueError(f"{ENV_KEEP}={keep} is below this model's bound {bound} (sliding_window "
                         f"{cfg.sliding_window} + the drafter's look-back {drafter_lookback(cfg)}): decoding would "
                         "read window rows the truncated prefill never wrote")
    source = cfg.kv_source_layer_ids[-1] if cfg.kv_source_layer_ids else None
    if source is None or cfg.layers[source].ratio != 1:
        raise ValueError("decoder prefill truncation needs a decoder: a last kv source of compress ratio 1; this "
                         f"model's kv sources {list(cfg.kv_source_layer_ids)} have ratios "
                         f"{[cfg.layers[s].ratio for s in cfg.kv_source_layer_ids]}")
    return source


@dataclass(slots=True)
class DecoderRows:
    """The rows of a ragged step the decoder runs on: ``rows`` [T'] of the step, as a step of their own."""

    rows: torch.Tensor
    layout: RaggedLayout
    states: list[PooledState]
    positions: torch.Tensor


def decoder_rows(batch: ForwardBatch, layout: RaggedLayout, states: list[PooledState], pool: StatePool,
                 keep: int) -> DecoderRows | None:
    """The decoder's rows of a ragged step (None: every row, nothing to cut)."""
    if batch.needed_from is None:
        return None
    floors = [max(0, needed + 1 - keep) for needed in batch.needed_from]
    firsts = [max(start, floor) for start, floor in zip(layout.starts, floors, strict=True)]
    window = pool.spec.window
    # a sequence needs the cut if it drops rows, or if its window reaches below its floor (rows the decoder of
    # an earlier chunk never wrote): a later chunk of a truncated prompt, or a short prompt
    if not any(first > start or 0 < floor and start - window + 1 < floor
               for first, start, floor in zip(firsts, layout.starts, floors, strict=True)):
        return None
    kept = [i for i, (first, start, n) in enumerate(zip(firsts, layout.starts, layout.lens, strict=True))
            if first < start + n]
    rows = [r for i in kept for r in range(layout.offsets[i] + firsts[i] - layout.starts[i],
                                             layout.offsets[i] + layout.lens[i])]
    device_rows = batch.upload(torch.tensor(rows, dtype=torch.int64))
    sub = RaggedLayout.build([layout.starts[i] + layout.lens[i] - firsts[i] for i in kept],
                             [firsts[i] for i in kept], batch.upload)
    positions = batch.positions[device_rows]
    picked = batch.upload(torch.tensor(kept, dtype=torch.int64))
    sub.entry_rows = BuiltOnUse(lambda r: layout.entry_rows[r][picked])
    slots = [states[i].slot for i in kept]
    sub_floors = [floors[i] for i in kept]
    sub_cached = [states[i].cached_tokens for i in kept]
    sub.plans = BuiltOnUse(lambda r: prefill_plan(sub, slots, positions, pool.spec.window, r,  # type: ignore[arg-type]
                                                  pool.entry_base(r) if r else 0, batch.upload, sub_floors,
                                                  sub_cached, pool.spec.ring))
    return DecoderRows(device_rows, sub, [states[i] for i in kept], positions)
