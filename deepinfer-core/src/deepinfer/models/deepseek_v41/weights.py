"""DeepSeek-V4.1 checkpoint tensors: released names and shapes per layer role.

Names are the released checkpoint's (``layers.N.attn.wq_a.weight``, ``layers.N.attn.compressor.wkv.weight``,
``layers.N.engram.embed.weight``, ...), which is what ``save_pretrained`` of transformers' model writes too.
The DSpark drafter's ``mtp.*`` tensors are checked with the rest and kept apart for speculative decoding (read
only when the drafter will run); the vision tower's (``vision.*``, ``aligner.*``, ``image_*``) and the image
tokens' router bias (``ffn.gate.bias_vl``) are ignored (DeepInfer runs the text model).  Any other name fails
the load, as does a role's layout that is not the released one (:meth:`WeightReader.check`), every problem
listed before any data is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from deepinfer.models.checkpoint import CheckpointError, SafetensorsCheckpoint
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.dspark_weights import expected_mtp_shapes
from deepinfer.models.deepseek_v41.roles import FULL
from deepinfer.models.layer_shapes import mlp_shapes, shared_layer_shapes
from deepinfer.models.tensor_checks import MXFP4_SCALE_DTYPES, problems_error
from deepinfer.models.weight_reader import Stored, WeightReader
from deepinfer.ops import Ops

#: Prefixes of tensors a text model never reads (the vision tower, its aligner, ``image_newline`` and the like).
IGNORED_PREFIXES = ("vision.", "aligner.", "image_")
#: The router bias of image tokens (backbone and draft layers alike).
IGNORED_SUFFIXES = (".ffn.gate.bias_vl",)


def ignored(name: str) -> bool:
    """Whether the text model skips checkpoint tensor ``name`` (vision parts, image-token biases)."""
    return name.startswith(IGNORED_PREFIXES) or name.endswith(IGNORED_SUFFIXES)


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
        shapes.update({f + "gate.weight": (experts, d), f + "gate.bias": (experts,)})
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
#: The other spelling of the DSpark confidence head's weight (both are seen in published loaders).
_CONFIDENCE = re.compile(r"^(mtp\.\d+\.confidence_head)\.weight$")


def fp8_blocks(name: str) -> tuple[tuple[int, int], ...]:
    """The FP8 blocks tensor ``name``'s role may use: an Engram table's rows, else :data:`FP8_BLOCKS`."""
    return (ENGRAM_BLOCK,) if name.endswith("engram.embed.weight") else FP8_BLOCKS


def fp8_block(name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """The FP8 block of tensor ``name`` read off its shapes: the one of :func:`fp8_blocks` whose block grid is
    ``scale_shape``.  Two that both fit give the same dequantized tensor (every block covers the whole tensor),
    so either serves; none fitting is an error (:meth:`WeightReader.check` lists it before anything loads)."""
    candidates = fp8_blocks(name)
    for bn, bk in candidates:
        if len(shape) == 2 and scale_shape == (-(-shape[0] // bn), -(-shape[1] // bk)):
            return bn, bk
    raise CheckpointError(f"{name}: FP8 weight of shape {shape} with scales {scale_shape}: no block size of "
                          f"{list(candidates)} gives that scale grid")


class _Reader(WeightReader):
    """The shared reader with V4.1's formats: each FP8 tensor's block read off its shapes, ue8m0 scales where the
    config says so, both spellings of the confidence head, and float Engram tables whose (unused) ``scale`` is
    ignored, as the reference does."""

    def __init__(self, ckpt: SafetensorsCheckpoint, cfg: DeepseekV41Config, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(ckpt, dtype, device, cfg.n_routed_experts)
        self.ue8m0 = cfg.quant is not None and cfg.quant.scale_fmt == "ue8m0"

    def canonical(self, raw: str) -> str:
        return _CONFIDENCE.sub(r"\1.proj.weight", super().canonical(raw))

    def ignores_scale(self, weight: str) -> bool:
        return weight.endswith("engram.embed.weight")

    def scale_dtypes(self, name: str, fmt: str) -> tuple[str, ...]:
        # (MXFP4's scale dtypes are the ue8m0 ones)
        return MXFP4_SCALE_DTYPES if self.ue8m0 else super().scale_dtypes(name, fmt)

    def fp8_blocks(self, name: str) -> tuple[tuple[int, int], ...]:
        return fp8_blocks(name)

    def block_of(self, name: str, shape: tuple[int, ...]) -> tuple[int, int]:
        scale = self.on_disk[name.removesuffix(".weight") + ".scale"]
        return fp8_block(name, shape, self.ckpt.shape(scale))

    def stays_stored(self, name: str) -> bool:
        return name.endswith("engram.embed.weight")  # rows are gathered and dequantized as they are looked up


#: DSpark tensors kept in fp32 whatever the compute dtype (besides the norms, mHC, sinks and biases).
MTP_FP32 = ("confidence_head.proj.weight",)


def read_weights(ckpt: SafetensorsCheckpoint, cfg: DeepseekV41Config, dtype: torch.dtype, device: torch.device,
                 keep: Callable[[str], bool] | None = None, rows: Callable[[str, int], slice | None] | None = None,
                 *, dequantize: Ops | None = None, drafter: bool = True, table_device: torch.device | None = None
                 ) -> tuple[dict[str, Stored], dict[str, Stored]]:
    """(the text model's tensors that ``keep`` accepts (default: all; an expert-parallel rank loads its own
    experts), the DSpark drafter's ``mtp.*``: none unless ``drafter``).  Every name, dtype, shape and layout is
    checked from the headers first, the drafter's too (all of it, unless the checkpoint has no ``mtp.*`` at all):
    raises :class:`CheckpointError` listing each missing, unexpected or mis-laid-out tensor.  ``rows(name, n)``:
    the rows of Engram table ``name`` (of ``n``) to load (a rank's shard), or None for all.  ``dequantize``:
    quantized weights become ``dtype`` through these ops as they load (the ``dequantize`` mode; Engram tables stay
    FP8); None: they stay as stored.  Engram tables are read :attr:`~WeightReader.CHUNK_BYTES` at a time (only a
    shard's rows) into ``table_device`` (default: ``device``; the host, for tables kept in host memory)."""
    reader = _Reader(ckpt, cfg, dtype, device)
    expected, drafts = expected_shapes(cfg), expected_mtp_shapes(cfg)
    if not any(n.startswith("mtp.") for n in reader.on_disk):
        drafts = {}  # a checkpoint saved without its drafter (transformers' save_pretrained): none to check
    problems = reader.layout_problems({**expected, **drafts}, ignored)
    if problems:
        raise problems_error(f"checkpoint {ckpt.directory} does not match its config", problems)
    if dequantize is not None:
        reader.dense = lambda q: q.dequantize(dequantize, dtype)

    def load(name: str, shape: tuple[int, ...]) -> Stored:
        if not name.endswith("engram.embed.weight"):
            return reader.load_kept(name, shape)
        shard = rows(name, shape[0]) if rows is not None else None
        return reader.load_kept(name, shape, slice(None) if shard is None else shard, table_device)

    tensors = {name: load(name, shape) for name, shape in expected.items() if keep is None or keep(name)}
    mtp = {name: reader.load_kept(name, shape) for name, shape in drafts.items()} if drafter else {}
    for name in [n for n in mtp if n.endswith(MTP_FP32)]:  # as vLLM builds it: an fp32 head
        mtp[name] = ckpt.get(reader.on_disk[name]).to(device=device, dtype=torch.float32)
    return tensors, mtp
