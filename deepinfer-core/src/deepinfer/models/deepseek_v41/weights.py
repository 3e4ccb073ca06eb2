"""DeepSeek-V4.1 checkpoint tensors: released names and shapes per layer role.

Names are the released checkpoint's (``layers.N.attn.wq_a.weight``, ``layers.N.attn.compressor.wkv.weight``,
``layers.N.engram.embed.weight``, ...), which is what ``save_pretrained`` of transformers' model writes too.
The DSpark drafter's ``mtp.*`` tensors are kept apart for speculative decoding; the vision tower's (``vision.*``,
``aligner.*``, ``image_*``) are ignored (DeepInfer runs the text model).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.models.checkpoint import CheckpointError, SafetensorsCheckpoint
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.roles import FULL
from deepinfer.models.layer_shapes import mlp_shapes, shared_layer_shapes
from deepinfer.models.weight_reader import Stored, WeightReader

#: Prefixes of tensors a text model never reads.
IGNORED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


def expected_shapes(cfg: DeepseekV41Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the text model (DSpark layers excluded) with its dense shape."""
    d, n_hc, hd = cfg.hidden_size, cfg.hc_mult, cfg.head_dim
    inter, experts = cfg.moe_intermediate_size, cfg.n_routed_experts
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, d), "norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["head.weight"] = (cfg.vocab_size, d)
    for role in cfg.layers:
        p = f"layers.{role.layer_id}."
        shapes.update(shared_layer_shapes(p, cfg, kv_norm="kv_norm"))
        a = p + "attn."
        if role.mode == FULL:
            shapes.update({a + "compressor.wkv.weight": (hd, d), a + "compressor.norm.weight": (hd,)})
            if role.ratio > 1:
                shapes[a + "compressor.wgate.weight"] = (hd, d)
            shapes.update({a + "indexer.wk.weight": (cfg.index_head_dim, hd),
                           a + "indexer.k_norm.weight": (cfg.index_head_dim,)})
        if role.is_index_source:
            shapes.update({a + "indexer.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
                           a + "indexer.weights_proj.weight": (cfg.index_n_heads, d)})
        f = p + "ffn."
        shapes.update({f + "gate.weight": (experts, d), f + "gate.bias": (experts,), f + "gate.bias_vl": (experts,)})
        for e in range(experts):
            shapes.update(mlp_shapes(f"{f}experts.{e}.", d, inter))
        shapes.update(mlp_shapes(f + "shared_experts.", d, inter))
        if role.engram:
            index = cfg.engram_layer_ids.index(role.layer_id)
            g = p + "engram."
            columns = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            shapes.update({
                g + "embed.weight": (cfg.engram_num_embeddings[index], cfg.engram_head_dim),
                g + "wkv.weight": ((n_hc + 1) * d, columns * cfg.engram_head_dim),
                g + "q_weight": (n_hc, d),
                g + "k_weight": (n_hc, d),
            })
    return shapes



# --- reading ------------------------------------------------------------------------------------------------
#: FP8 block sizes a dense weight may use (the config advertises one; only part of the real checkpoint uses it).
FP8_BLOCKS = ((32, 32), (128, 128))
#: Engram tables: FP8 rows with one ue8m0 scale per 32 columns.
ENGRAM_BLOCK = (1, 32)


def fp8_block(name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """The FP8 block of tensor ``name`` read off its shapes: the one of :data:`FP8_BLOCKS` (or, for an Engram
    table, :data:`ENGRAM_BLOCK`) whose block grid is ``scale_shape``.  Two that both fit give the same
    dequantized tensor (every block covers the whole tensor), so either serves; none fitting is an error."""
    if name.endswith("engram.embed.weight"):
        candidates: tuple[tuple[int, int], ...] = (ENGRAM_BLOCK,)
    else:
        candidates = FP8_BLOCKS
    for bn, bk in candidates:
        if len(shape) == 2 and scale_shape == (-(-shape[0] // bn), -(-shape[1] // bk)):
            return bn, bk
    raise CheckpointError(f"{name}: FP8 weight of shape {shape} with scales {scale_shape}: no block size of "
                          f"{list(candidates)} gives that scale grid")


class _Reader(WeightReader):
    """The shared reader with V4.1's formats: each FP8 tensor's block read off its shapes, and float Engram tables
    whose (unused) ``scale`` is ignored, as the reference does."""

    def quant_format(self, weight: str) -> str | None:
        if weight.endswith("engram.embed.weight") and self.ckpt.dtype_name(self.on_disk[weight]) in _FLOAT_DTYPES:
            return None
        return super().quant_format(weight)

    def block_of(self, name: str, shape: tuple[int, ...]) -> tuple[int, int]:
        scale = self.on_disk[name.removesuffix(".weight") + ".scale"]
        return fp8_block(name, shape, self.ckpt.shape(scale))


_FLOAT_DTYPES = ("F32", "BF16", "F16")
#: DSpark tensors kept in fp32 whatever the compute dtype (besides the norms, mHC, sinks and biases).
MTP_FP32 = ("confidence_head.proj.weight",)


def read_weights(ckpt: SafetensorsCheckpoint, cfg: DeepseekV41Config, dtype: torch.dtype, device: torch.device,
                 keep: Callable[[str], bool] | None = None, rows: Callable[[str, int], slice | None] | None = None,
                 table_device: torch.device | None = None) -> tuple[dict[str, Stored], dict[str, Stored]]:
    """(the text model's tensors that ``keep`` accepts (default: all; an expert-parallel rank loads its own
    experts), the DSpark drafter's ``mtp.*``), checked by name and shape from the headers first; raises
    :class:`CheckpointError` listing each missing, unexpected or mis-shaped tensor.  ``rows(name, n)``: the rows
    of Engram table ``name`` (of ``n``) to load (a rank's shard), or None for all; only those are read.
    ``table_device``: where Engram tables go (default: ``device``; the host, for tables kept in host memory)."""
    reader = _Reader(ckpt, dtype, device, cfg.n_routed_experts)
    expected = expected_shapes(cfg)
    scales = {n.removesuffix(".weight") + ".scale" for n in reader.on_disk if n.endswith(".weight")}
    scales &= set(reader.on_disk)
    mtp = sorted(n for n in reader.on_disk if n.startswith("mtp."))
    problems = [f"{n}: missing (expected shape {expected[n]})" for n in expected if n not in reader.on_disk]
    unexpected = set(reader.on_disk) - set(expected) - scales - set(mtp)
    unexpected = {n for n in unexpected if not n.startswith(IGNORED_PREFIXES)}
    problems += [f"{n}: unexpected tensor of shape {ckpt.shape(reader.on_disk[n])}" for n in sorted(unexpected)]
    for name, shape in expected.items():
        if name in reader.on_disk:
            problems += reader.check(name, shape)
    if problems:
        head = f"checkpoint {ckpt.directory} does not match its config ({len(problems)} problems):\n  "
        raise CheckpointError(head + "\n  ".join(problems))
    def load(name: str, shape: tuple[int, ...]) -> Stored:
        if not name.endswith("engram.embed.weight"):
            return reader.load(name, shape)
        shard = rows(name, shape[0]) if rows is not None else None
        return reader.load(name, shape, slice(None) if shard is None else shard, table_device)

    tensors = {name: load(name, shape) for name, shape in expected.items() if keep is None or keep(name)}
    drafter = {n: reader.load(n, None) for n in mtp if not n.endswith(".scale")}
    for name in [n for n in drafter if n.endswith(MTP_FP32)]:  # as vLLM builds it: an fp32 head
        drafter[name] = ckpt.get(reader.on_disk[name]).to(device=device, dtype=torch.float32)
    return tensors, drafter
