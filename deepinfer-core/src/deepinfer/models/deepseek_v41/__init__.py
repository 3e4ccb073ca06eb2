"""DeepSeek-V4.1 (``model_type: deepseek_v41``, and the flat ``deepseek_v41_text``)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from deepinfer import envs
from deepinfer.backends.backend import Backend
from deepinfer.models.checkpoint import CheckpointError, SafetensorsCheckpoint
from deepinfer.models.deepseek_v41.config import ConfigError, DeepseekV41Config
from deepinfer.models.deepseek_v41.engram_placement import place_tables, table_device
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.roles import FULL, REINDEX, REUSE, SWA, LayerRole
from deepinfer.models.deepseek_v41.token_map import CompressedTokenMap
from deepinfer.models.deepseek_v41.truncation import cut_layer
from deepinfer.models.deepseek_v41.weights import read_weights
from deepinfer.models.weights_mode import weights_mode
from deepinfer.ops import Ops
from deepinfer.parallel.context import ParallelContext

__all__ = ["FULL", "REINDEX", "REUSE", "SWA", "ConfigError", "DeepseekV41Config", "DeepseekV41ForCausalLM",
           "LayerRole", "load"]

logger = logging.getLogger(__name__)


def load(path: str | Path, *, ops: Ops, dtype: torch.dtype, device: torch.device,
         parallel: ParallelContext | None = None, drafter: bool = True, engram_placement: str = "host",
         backend: Backend | None = None) -> DeepseekV41ForCausalLM:
    """Build the model from a checkpoint directory (config.json, safetensors, and tokenizer.json, from which
    Engram's compressed token map is derived).  ``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact`` turns on
    decoder prefill truncation with ``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS`` kept rows (checked here).
    ``parallel``: this rank's parallel context (None: one process).  Quantized weights stay as stored or become
    ``dtype`` by :func:`~deepinfer.models.weights_mode.weights_mode`; ``DEEPINFER_QUANTIZED_KV=1`` stores the state
    in the model's KV formats.  ``drafter``: read the DSpark drafter's tensors (False where speculative decoding
    will not run: they are still checked).  ``engram_placement``: where the Engram tables live
    (:mod:`.engram_placement`): ``"host"`` memory that ``backend.host_resident`` hands the device (None: the base
    :class:`Backend`'s), or ``"device"``."""
    cfg = DeepseekV41Config.from_file(path)
    keep = envs.yoco_prefill_keep_tokens() if envs.yoco_prefill_truncation_mode() == "compact" else None
    if keep is not None:
        cut_layer(cfg, keep)  # refuse a bad KEEP before reading the weights
    mode = weights_mode(ops)
    device = torch.device(device)
    tensors, mtp = read_weights(SafetensorsCheckpoint(path), cfg, dtype, device,
                                keep=parallel.loads if parallel is not None else None,
                                rows=parallel.table_rows if parallel is not None else None,
                                dequantize=None if mode.native else ops, drafter=drafter,
                                table_device=table_device(engram_placement, device))
    if cfg.quant is not None:
        mode.log(path)
    if cfg.engram_layer_ids and engram_placement == "host":
        held = place_tables(tensors, (backend or Backend()).host_resident, device)
        logger.info("Engram tables: %.2f GiB in host memory, read in place by %s (engram_placement='host')",
                    held / 2**30, device)
    token_map = None
    if cfg.engram_layer_ids:
        if not (Path(path) / "tokenizer.json").is_file():
            raise CheckpointError(f"{path}: no tokenizer.json; V4.1's Engram layers {list(cfg.engram_layer_ids)} hash "
                                  "token ids through a map derived from the checkpoint's own tokenizer")
        token_map = CompressedTokenMap.from_file(path, cfg.engram_compressed_vocab_size).lookup(
            cfg.vocab_size, cfg.engram_pad_id)
    return DeepseekV41ForCausalLM(cfg, tensors, mtp, token_map, ops=ops, dtype=dtype, device=device,
                                  decoder_keep=keep, parallel=parallel,
                                  native_weights=mode.native, quantized_kv=envs.quantized_kv())
