"""DeepSeek-V4 checkpoint tensors: the released names and shapes, validation, and loading.

Names are the released checkpoint's (``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.weight``,
``layers.N.hc_attn_fn``, ...), which is also what ``save_pretrained`` of the transformers model writes; the
shared :class:`~deepinfer.models.weight_reader.WeightReader` maps stored names to them and reads quantized
weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.models.checkpoint import SafetensorsCheckpoint
from deepinfer.models.deepseek_v4.config import CSA, HASH_MOE, SLIDING, DeepseekV4Config
from deepinfer.models.layer_shapes import mlp_shapes, shared_layer_shapes
from deepinfer.models.tensor_checks import problems_error
from deepinfer.models.weight_reader import DEFAULT_BLOCK, Stored, WeightReader
from deepinfer.ops import Ops


def expected_shapes(cfg: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the main model (MTP layers excluded) with its dense shape."""
    d, n_hc, hd, inter = cfg.hidden_size, cfg.hc_mult, cfg.head_dim, cfg.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (cfg.vocab_size, d),
        "norm.weight": (d,),
        "hc_head_fn": (n_hc, n_hc * d),
        "hc_head_base": (n_hc,),
        "hc_head_scale": (1,),
    }
    if not cfg.tie_word_embeddings:
        shapes["head.weight"] = (cfg.vocab_size, d)
    for i, (kind, ratio, mlp) in enumerate(zip(cfg.layer_types, cfg.compress_ratios, cfg.mlp_layer_types, strict=True)):
        p = f"layers.{i}."
        shapes.update(shared_layer_shapes(p, cfg, kv_norm="norm"))
        a = p + "attn."
        if kind != SLIDING:
            width = (2 if kind == CSA else 1) * hd  # CSA projects two overlapping series
            _compressor(shapes, a + "compressor.", d, width, hd, ratio)
        if kind == CSA:
            ih = cfg.index_head_dim
            shapes.update({
                a + "indexer.wq_b.weight": (cfg.index_n_heads * ih, cfg.q_lora_rank),
                a + "indexer.weights_proj.weight": (cfg.index_n_heads, d),
            })
            _compressor(shapes, a + "indexer.compressor.", d, 2 * ih, ih, ratio)
        f = p + "ffn."
        shapes[f + "gate.weight"] = (cfg.n_routed_experts, d)
        if mlp == HASH_MOE:
            shapes[f + "gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
        else:
            shapes[f + "gate.bias"] = (cfg.n_routed_experts,)
        for e in range(cfg.n_routed_experts):
            shapes.update(mlp_shapes(f"{f}experts.{e}.", d, inter))
        shapes.update(mlp_shapes(f + "shared_experts.", d, inter * cfg.n_shared_experts))
    return shapes


def _compressor(shapes: dict, prefix: str, d: int, width: int, out_dim: int, ratio: int) -> None:
    shapes.update({prefix + "wkv.weight": (width, d), prefix + "wgate.weight": (width, d),
                   prefix + "ape": (ratio, width), prefix + "norm.weight": (out_dim,)})


@dataclass(slots=True)
class V4Weights:
    """Tensors as stored (quantized ones stay quantized), on the target device, by released name."""

    tensors: dict[str, Stored]
    mtp: dict[str, Stored] = field(default_factory=dict)  # `mtp.*`, kept for speculative decoding


def read_weights(
    ckpt: SafetensorsCheckpoint, cfg: DeepseekV4Config, dtype: torch.dtype, device: torch.device,
    keep: Callable[[str], bool] | None = None, *, dequantize: Ops | None = None, drafter: bool = True,
) -> V4Weights:
    """Check every name, shape, dtype and layout from the headers, then load (only the tensors ``keep`` accepts: an
    expert-parallel rank loads its own experts), checking values.  Raises
    :class:`CheckpointError` listing each missing, unexpected, mis-shaped or mis-typed tensor with its file,
    name, and what was expected and found; or naming the first tensor with a NaN / inf or an id out of range.
    ``dequantize``: quantized weights become ``dtype`` through these ops as they load; None: they stay as stored.
    ``drafter``: read the MTP layer's ``mtp.*`` tensors (their dtypes are checked either way)."""
    reader = WeightReader(ckpt, dtype, device, cfg.n_routed_experts,
                          cfg.quant.weight_block_size if cfg.quant is not None else DEFAULT_BLOCK)
    expected = expected_shapes(cfg)
    mtp_weights = sorted(n for n in reader.on_disk if n.startswith("mtp.") and not n.endswith(".scale"))
    problems = reader.layout_problems(expected, lambda n: n.startswith("mtp."))
    for name in mtp_weights:
        problems += reader.dtype_problems(name)
    if problems:
        raise problems_error(f"checkpoint {ckpt.directory} does not match its config", problems)
    if dequantize is not None:
        reader.dense = lambda q: q.dequantize(dequantize, dtype)
    tensors = {name: reader.load_kept(name, shape) for name, shape in expected.items() if keep is None or keep(name)}
    mtp_tensors = {n: reader.load_kept(n, None) for n in mtp_weights} if drafter else {}
    return V4Weights(tensors, mtp_tensors)
