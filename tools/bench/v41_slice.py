"""Benchmark a DeepSeek-V4.1-Flash slice on one GPU against the roofline measured in the same run.

The slice has V4.1-Flash's per-layer dims: hidden 5120, 4 mHC streams (single-pass), 64 heads x 512 (rope 64),
q_lora 1280, o_groups 8 x 1024, 384 routed experts top-6 + 1 shared of 2304 (``gate_temp``), index 32 heads x 128
top-512 with candidate blocks of 8 (top 2048), vocab 129280, bf16 random weights; 8 layers covering every role:

    layer  0      SWA + Engram (n-grams up to 4 x 8 heads, head dim 256)
    layers 1-3    ratio 2 (the encoder): Full (the group's KV source), Reuse, Reindex
    layers 4-7    ratio 1 (the decoder): Full (KV source, candidate source), Reuse, Reindex (in the candidate
                  pool), Reuse

The routed experts are one [385, ...] stack that every layer reads (8 layers of their own, 27 GB each, would
not fit in 141 GB); each layer routes with its own router, and one layer's top-6 experts (0.4 GB) do not fit in
L2, so every layer still reads its experts from HBM, as the model would.

Cases: prefill 1 x 1024 tokens; decode steps at batch 1 / 16 / 64 after ``CONTEXT`` (2048) tokens per sequence,
replayed from CUDA graphs (``--eager`` too: eager steps).  The context is long enough that every indexer picks
(ratio 1: 2048 entries, ratio 2: 1024, both above the top-512).  The roofline of a case is max(bytes / copy
bandwidth, FLOPs / bf16 matmul rate), both measured in this run: bytes = every weight the step reads once (routed
experts: the expected number of distinct experts hit per layer; Engram: the looked-up rows), FLOPs = 2 x
touched-per-token parameters x tokens (attention and indexer scores left out).  With 384 experts every case is
bound by the bytes, the 1024-token prefill too (222 GB against 6.6 TFLOP): its MFU is printed, the fraction of the
roofline is the number to compare.  Prints a markdown table and JSON.

``--released`` also runs the slice in V4.1-Flash's released formats, kept as stored (``DEEPINFER_QUANTIZED_WEIGHTS
=native``, ``DEEPINFER_QUANTIZED_KV=1``): dense projections FP8 e4m3 with ue8m0 32x32 block scales, routed
experts MXFP4 (e2m1 + e8m0 per 32), the shared expert FP8 (its own, per layer), the Engram table FP8 (ue8m0 per 32
columns), the state packed (SWA 528 B, latent 288 B, indexer key 68 B a row); the bf16 slice runs first in the same
process.  Its roofline counts the bytes actually stored, and its FLOPs at the FP8 matmul rate (measured now,
cuBLAS ``_scaled_mm``) for the FP8 GEMMs, at the bf16 rate for the rest (MXFP4 experts are dequantized to bf16
in the tile); prefill prints its rate against the FP8 ceiling.  Weight and state memory of both are printed.

``--engram device,host`` times the decode cases with the Engram table in device memory, then in host memory (the
engine's default, ``engram_placement="host"``: pinned, read by the kernels in place through UVA) in the same run,
and prints each case's ratio (the target: within 3%); ``--engram host`` alone runs every case with it in host
memory.  ``--engram-vocab`` sets the table's first prime bucket (rows: ~24x it; V4.1-Flash's is 16,000,000, 384M
rows a layer): a larger table shows what scattered reads of host memory cost.

    python -m tools.bench.v41_slice [--json PATH] [--cases prefill,decode1,decode16,decode64] [--eager] [--released]
                                    [--profile] [--engram device,host] [--engram-vocab N]
    python -m tools.bench.v41_slice --tiny      # a small config on the CPU (reference ops): tests the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from tools.bench.steps import SwitchableOps, backend_for, deepinfer_cases, jit_launches
from tools.ceilings import Ceilings, ceilings

#: V4.1-Flash's per-layer dims; ``n_routed_experts`` is what the layers route over (see ``EXPERTS``).
SLICE: dict[str, Any] = dict(
    model_type="deepseek_v41_text", vocab_size=129280, hidden_size=5120, num_hidden_layers=8,
    num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024,
    n_routed_experts=8, num_experts_per_tok=6, moe_intermediate_size=2304, gate_temp=1.3, hc_mult=4,
    index_n_heads=32, index_head_dim=128, index_topk=512, candidate_block_size=8, candidate_topk_blocks=2048,
    compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1], kv_source_layer_ids=[1, 4], index_source_layer_ids=[1, 3, 4, 6],
    candidate_source_layer_id=4, engram_layer_ids=[0], engram_vocab_size=40000, engram_max_ngram_size=4,
    engram_n_heads=8, engram_head_dim=256, engram_compressed_vocab_size=99092, num_nextn_predict_layers=0,
    rms_norm_eps=1e-20, max_position_embeddings=65536,
)
#: The tiny CPU config: the same layer roles at toy dims.
TINY: dict[str, Any] = dict(
    SLICE, vocab_size=512, hidden_size=64, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, moe_intermediate_size=32, index_n_heads=4, index_head_dim=32, index_topk=8,
    candidate_topk_blocks=4, engram_vocab_size=101, engram_head_dim=16, engram_compressed_vocab_size=300,
    max_position_embeddings=4096, sliding_window=16,
)


@dataclasses.dataclass(slots=True, frozen=True)
class Shape:
    """One run's sizes: the config, the routed experts every layer reads, and the cases' token counts."""

    config: dict[str, Any]
    experts: int
    prefill: int
    context: int
    max_seqs: int
    device: str
    #: The Engram table's first prime bucket (``engram_vocab_size``); None: the config's.
    engram_vocab: int | None = None


FULL = Shape(SLICE, 384, 1024, 2048, 64, "cuda")
#: The released format's FP8 projections (V4.1-Flash: 32x32 blocks, ue8m0 scales; V4 used 128x128); "experts."
#: holds the shared expert's too, which the slice gives each layer apart.
FP8_DENSE = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.")
FP8_BLOCK = (32, 32)
MXFP4_SCALE = 127 - 8  # e8m0 exponent of the random MXFP4 experts' scales (|w| <= 6 * 2^-8)
SMALL = Shape(TINY, 16, 64, 80, 64, "cpu")


def _config(shape: Shape):
    from deepinfer.models.deepseek_v41.config import DeepseekV41Config
    from deepinfer.models.deepseek_v41.engram_hash import is_prime

    raw = dict(shape.config)
    if shape.engram_vocab is not None:
        raw["engram_vocab_size"] = shape.engram_vocab
    # the table holds the buckets: the consecutive primes >= engram_vocab_size, one per (n-gram size, head)
    candidate, rows = raw["engram_vocab_size"] - 1, 0
    for _ in range((raw["engram_max_ngram_size"] - 1) * raw["engram_n_heads"]):
        candidate += 1
        while not is_prime(candidate):
            candidate += 1
        rows += candidate
    raw["engram_num_embeddings"] = [rows]
    return DeepseekV41Config.from_dict(raw)


def _is_fp8(name: str) -> bool:
    return name.endswith(".weight") and any(p in name for p in FP8_DENSE)


def _released(tensors: dict[str, Any]) -> None:
    """The FP8 projections quantized as released, in place (the Engram tables are drawn quantized:
    :func:`_fp8_engram_table`)."""
    from deepinfer.quant import quantize_fp8_block

    for name, t in tensors.items():
        if _is_fp8(name):
            tensors[name] = quantize_fp8_block(t.float(), FP8_BLOCK, "ue8m0")


def _fp8_engram_table(rows: int, cols: int, gen: Any, device: Any, chunk: int = 1 << 20) -> Any:
    """An N(0, 1) Engram table in the released FP8 (1 x 32 blocks, ue8m0), drawn and quantized a chunk of
    rows at a time: a 96M-row table never exists in bf16 or fp32 on the device."""
    import torch

    from deepinfer.quant import QuantizedTensor, quantize_fp8_block

    data = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(rows, -(-cols // 32), dtype=torch.float8_e8m0fnu, device=device)
    for start in range(0, rows, chunk):
        part = quantize_fp8_block(torch.randn(min(chunk, rows - start), cols, generator=gen, device=device),
                                  (1, 32), "ue8m0")
        data[start:start + len(part.data)], scale[start:start + len(part.data)] = part.data, part.scale
    return QuantizedTensor(part.format, data, scale, (rows, cols), (1, 32))


def _mxfp4_experts(moe: Any, e: int, hidden: int, inter: int, gen: Any, rand: Any) -> None:
    """Point ``moe`` at ``e`` random MXFP4 routed experts (packed bytes, one scale exponent) and a shared FP8
    expert of its own."""
    import torch

    from deepinfer.quant import quantize_fp8_block

    device = moe.gate.device

    def packed(n: int, k: int) -> tuple[Any, Any]:
        data = torch.randint(0, 256, (e, n, k // 2), generator=gen, device=device, dtype=torch.uint8)
        return data, torch.full((e, n, k // 32), MXFP4_SCALE, device=device, dtype=torch.uint8)

    (moe.w13, s13), (moe.w2, s2) = packed(2 * inter, hidden), packed(hidden, inter)
    moe.scales, moe.shared_id, moe.fp8_block = (s13, s2), None, None  # MXFP4: no FP8 block
    # w1 | w3 quantized as one tensor: as the model stacks them when I is a multiple of the block (2304 is)
    moe.shared = (quantize_fp8_block(rand(2 * inter, hidden).float(), FP8_BLOCK),
                  quantize_fp8_block(rand(hidden, inter).float(), FP8_BLOCK))


def random_generator(device: str, seed: int = 0):
    """``rand(*dims, dtype=bf16)``: N(0, 1/fan_in) matrices (N(0, 1) vectors) from one seeded generator, and the
    generator."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*dims: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        t = torch.randn(*dims, generator=gen, device=device, dtype=dtype)
        return t.mul_(dims[-1] ** -0.5) if len(dims) > 1 else t

    return rand, gen


def _random_tensors(shapes: dict[str, tuple[int, ...]], rand: Any, gen: Any, device: Any,
                    released: bool = False) -> dict[str, Any]:
    """Random tensors of ``shapes`` (norms 1, fp32 where the loader keeps fp32, Engram tables N(0, 1);
    ``released``: the Engram tables in FP8, as released)."""
    import torch

    from deepinfer.models.deepseek_v41.weights import MTP_FP32
    from deepinfer.models.weight_reader import keeps_fp32

    tensors = {}
    for name, dims in shapes.items():
        fp32 = keeps_fp32(name) or "hc_" in name or name.endswith(MTP_FP32)
        dtype = torch.float32 if fp32 else torch.bfloat16
        if name.endswith(("norm.weight", "q_weight", "k_weight")):
            tensors[name] = torch.ones(dims, dtype=dtype, device=device)
        elif name.endswith("embed.weight") and name.startswith("layers.") and released:
            tensors[name] = _fp8_engram_table(*dims, gen, device)
        elif name.endswith("embed.weight") and name.startswith("layers."):  # an Engram table: O(1) rows
            tensors[name] = torch.randn(*dims, generator=gen, device=device, dtype=dtype)
        else:
            tensors[name] = rand(*dims, dtype=dtype)
    return tensors


def expert_stack(experts: int, hidden: int, inter: int, rand: Any) -> tuple[Any, Any]:
    """(w13 [E + 1, 2I, H], w2 [E + 1, H, I]): ``experts`` routed experts and, last, the shared one."""
    return rand(experts + 1, 2 * inter, hidden), rand(experts + 1, hidden, inter)


def new_router(moe: Any, experts: int, rand: Any, gen: Any) -> None:
    """Give ``moe`` a random router over ``experts`` experts."""
    import torch

    device = moe.gate.device
    moe.gate = rand(experts, moe.gate.shape[1])
    moe.bias = 0.1 * torch.randn(experts, generator=gen, device=device)
    moe.spec = dataclasses.replace(moe.spec, n_routed_experts=experts)


def read_stack(moe: Any, stack: tuple[Any, Any]) -> None:
    """Point ``moe`` at a shared :func:`expert_stack` (its last expert: the shared one, weight 1 for every
    token), as the model stacks its own experts."""
    import torch

    w13, w2 = stack
    shared = w13.shape[0] - 1
    moe.w13, moe.w2, moe.shared_id, moe.scales, moe.shared = w13, w2, shared, None, None
    moe.shared_slot = (torch.full((1, 1), shared, dtype=torch.int64, device=w13.device),
                       torch.ones((1, 1), dtype=torch.float32, device=w13.device))


def build_model(shape: Shape, ops: Any, released: bool = False):
    """The slice's model with random weights (N(0, 1/fan_in) matrices, norms 1, fp32 where the loader keeps
    fp32), its MoE layers then pointed at one shared stack of ``shape.experts`` routed experts + the shared one;
    ``released``: in the released formats, kept as stored (MXFP4 experts, and a shared FP8 expert per layer).
    A config with draft layers also gets random ``mtp.*`` tensors (bf16 only; their experts as in the config:
    ``tools.bench.v41_slice_engine`` points them at a stack of their own)."""
    import torch

    from deepinfer.models.deepseek_v41.dspark_weights import expected_mtp_shapes
    from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from deepinfer.models.deepseek_v41.weights import expected_shapes

    cfg = _config(shape)
    if released and cfg.num_nextn_predict_layers:
        raise ValueError("the released-format slice has no drafter")
    device = torch.device(shape.device)
    rand, gen = random_generator(shape.device)
    tensors = _random_tensors(expected_shapes(cfg), rand, gen, device, released)
    if released:
        _released(tensors)
    token_map = torch.randint(0, cfg.engram_compressed_vocab_size, (cfg.vocab_size,), generator=gen, device=device)
    mtp = _random_tensors(expected_mtp_shapes(cfg), rand, gen, device)
    model = DeepseekV41ForCausalLM(cfg, tensors, mtp, token_map, ops=ops, dtype=torch.bfloat16, device=device,
                                   native_weights=released, quantized_kv=released)
    del tensors
    e, hidden, inter = shape.experts, cfg.hidden_size, cfg.moe_intermediate_size
    stack = None if released else expert_stack(e, hidden, inter, rand)
    for layer in model.layers:
        new_router(layer.ffn, e, rand, gen)
        if stack is None:
            _mxfp4_experts(layer.ffn, e, hidden, inter, gen, rand)
        else:
            read_stack(layer.ffn, stack)
    return model


@dataclasses.dataclass(slots=True)
class Bytes:
    """What a step reads, in bytes: ``dense`` once a step, ``expert`` per distinct routed expert a layer hits,
    ``shared`` the layer's shared expert, ``per_token`` per token (its embedding and Engram rows), ``head`` once
    (the logits); ``dense_params`` / ``expert_params``: the parameters a token multiplies (for the FLOPs), of which
    ``fp8_params`` (and the shared experts' if ``shared_fp8``) run as FP8 GEMMs; ``resident``: the bytes the
    slice's weights hold with every layer's own experts (what the model would)."""

    dense: int
    expert: int
    shared: int
    per_token: int
    head: int
    dense_params: int
    fp8_params: int
    expert_params: int
    shared_fp8: bool
    layers: int
    experts: int
    top_k: int
    resident: int

    def expected_hit(self, tokens: int) -> float:
        """Distinct routed experts a layer hits on average when ``tokens`` tokens route uniformly at random."""
        return self.experts * (1 - (1 - self.top_k / self.experts) ** tokens)

    def touched(self, tokens: int) -> tuple[float, float, float]:
        """(bytes read, FLOPs, of which FP8 GEMM FLOPs) of a step over ``tokens`` tokens."""
        read = (self.dense + (self.expected_hit(tokens) * self.expert + self.shared) * self.layers
                + tokens * self.per_token + self.head)
        per_token = self.dense_params + (self.top_k + 1) * self.expert_params * self.layers
        fp8 = self.fp8_params + (self.expert_params * self.layers if self.shared_fp8 else 0)
        return read, 2.0 * per_token * tokens, 2.0 * fp8 * tokens


def _fp8_bytes(rows: int, cols: int) -> int:
    """An FP8 weight with one ue8m0 byte per block (``FP8_BLOCK``)."""
    return rows * cols + -(-rows // FP8_BLOCK[0]) * -(-cols // FP8_BLOCK[1])


def count_bytes(cfg: Any, shape: Shape, released: bool = False) -> Bytes:
    """:class:`Bytes` of the slice from its tensors' names and shapes (``expected_shapes``), with the routers
    and experts at ``shape.experts`` (the model is built with fewer, then shares one stack: see :func:`build_model`);
    ``released``: as stored in the released formats."""
    import math

    from deepinfer.models.deepseek_v41.weights import expected_shapes
    from deepinfer.models.weight_reader import keeps_fp32

    dense = dense_params = fp8_params = 0
    for name, dims in expected_shapes(cfg).items():
        n = math.prod(dims)
        if "experts." in name or name in ("embed.weight", "head.weight") or name.endswith("engram.embed.weight"):
            continue  # per expert hit, per token or per sequence: below
        if ".ffn.gate." in name:
            n = n // cfg.n_routed_experts * shape.experts
        if released and _is_fp8(name):
            dense, fp8_params = dense + _fp8_bytes(*dims), fp8_params + n
        else:
            dense += n * (4 if keeps_fp32(name) or "hc_" in name else 2)
        dense_params += n
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    expert_params = 3 * hidden * inter
    if released:  # MXFP4: half a byte a value and a byte per 32; the shared expert FP8
        expert, shared = expert_params // 2 + expert_params // 32, 2 * _fp8_bytes(inter, hidden) + _fp8_bytes(
            hidden, inter)
    else:
        expert = shared = 2 * expert_params
    engram_row = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
    value_bytes = 1 + 1 / 32 if released else 2  # an Engram value: FP8 + ue8m0 per 32, or bf16
    engram = int(engram_row * len(cfg.engram_layer_ids) * value_bytes)
    table = int(sum(cfg.engram_num_embeddings) * cfg.engram_head_dim * value_bytes)
    embeddings = (1 if cfg.tie_word_embeddings else 2) * 2 * cfg.vocab_size * hidden
    layers = cfg.num_hidden_layers
    return Bytes(dense, expert, shared, 2 * hidden + engram, 2 * cfg.vocab_size * hidden, dense_params, fp8_params,
                 expert_params, released, layers, shape.experts, cfg.num_experts_per_tok,
                 dense + layers * (shape.experts * expert + shared) + embeddings + table)


def report(rows: list[dict[str, Any]], counts: Bytes, roof: Ceilings, device: str, title: str = "bf16") -> str:
    """A markdown table: each case's time, its roofline and the fraction of it reached (prefill: MFU too; without
    an FP8 rate, FP8 GEMMs count at the bf16 rate)."""
    bw, peak = roof.bandwidth, roof.bf16_flops
    fp8_peak = roof.fp8_flops or peak
    fp8_note = f", FP8 matmul {roof.fp8_flops / 1e12:.1f} TFLOP/s" if roof.fp8_flops else ""
    lines = [f"{title} slice on {device}; ceilings measured now: copy {bw / 1e12:.3f} TB/s, bf16 matmul "
             f"{peak / 1e12:.1f} TFLOP/s{fp8_note}; dense {counts.dense / 1e9:.2f} GB, one expert "
             f"{counts.expert / 1e6:.1f} MB; weights {counts.resident / 1e9:.1f} GB (every layer its experts)",
             "", "| case | ms (graph step) | ms (replay) | roofline ms | bound | HBM GB | fraction of roofline |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        read, flops, fp8 = counts.touched(r["tokens"])
        t_mem, t_math = read / bw, (flops - fp8) / peak + fp8 / fp8_peak
        floor = max(t_mem, t_math)
        best = min(r["s"], r.get("replay_s", r["s"]))
        r.update(floor_s=floor, bound="memory" if t_mem >= t_math else "math", bytes=read, flops=flops,
                 fp8_flops=fp8, fraction=floor / best)
        replay = f"{r['replay_s'] * 1e3:.2f}" if "replay_s" in r else "-"
        frac = f"{floor / best:.0%}"
        if r["case"].startswith("prefill"):
            frac += f" (MFU {r['flops'] / best / peak:.0%} of bf16"
            frac += f", {r['flops'] / best / roof.fp8_flops:.0%} of FP8)" if roof.fp8_flops else ")"
        lines.append(f"| {r['case']} | {r['s'] * 1e3:.2f} | {replay} | {floor * 1e3:.3f} | {r['bound']} | "
                     f"{read / 1e9:.2f} | {frac} |")
    return "\n".join(lines)


def run_slice(shape: Shape, table: Any, cases: list[str], eager: bool, released: bool, roof: Ceilings,
              device: str, profile: bool = False, engram: tuple[str, ...] = ("device",)) -> dict[str, Any]:
    """Build the slice (bf16, or ``released``), time its cases with the Engram table in ``engram[0]``'s memory
    (then the decode cases in each other placement: :func:`engram_report`), print its report; the results as plain
    data."""
    from deepinfer.kv.sizing import describe_density, tokens_per_gib

    model = build_model(shape, SwitchableOps(table), released)
    tables = built_tables(model)
    place_engram(tables, engram[0], model.device)
    counts = count_bytes(model.config, shape, released)
    model.configure_state(shape.max_seqs, model.state_pool_bytes(shape.max_seqs, max(shape.prefill,
                                                                                      shape.context + 64)))
    state_bytes, density = model.pool.nbytes(), tokens_per_gib(model.state_spec, 2)
    variants = {"graphs": True, "eager": False} if eager else {"graphs": True}
    times = {v: deepinfer_cases(model, cases, graphs, prefill=shape.prefill, context=shape.context,
                                max_seqs=shape.max_seqs, device=shape.device, profile=profile and graphs)
             for v, graphs in variants.items()}
    rows = []
    for key, seconds in times["graphs"].items():
        if not isinstance(seconds, float) or key.endswith("replay"):
            continue
        tokens = shape.prefill if key.startswith("prefill") else int(key.split()[1][1:])
        row: dict[str, Any] = {"case": key, "tokens": tokens, "s": seconds}
        if key + " replay" in times["graphs"]:
            row["replay_s"] = times["graphs"][key + " replay"]
        if "eager" in times:
            row["eager_s"] = times["eager"][key]
        rows.append(row)
    title = "released-format (FP8 / MXFP4 / packed KV)" if released else "bf16"
    print(report(rows, counts, roof, device, title))
    for key, value in times["graphs"].items():
        if key.endswith(" profile"):
            print(f"\n{title}, {key} (kernels of replayed steps):\n{value}")
        elif key.endswith(" experts hit") and value:
            uniform = counts.expected_hit(int(key.split()[1][1:]))
            print(f"{title}, {key[:-len(' experts hit')]}: distinct routed experts a layer hits {value} (the "
                  f"roofline counts {uniform:.0f}, uniform routes)")
    print(f"state pool: {state_bytes / 1e9:.2f} GB for {shape.max_seqs} sequences; "
          f"{describe_density(model.state_spec, 2)}\n")
    placed = {engram[0]: times["graphs"]}
    for placement in engram[1:]:
        place_engram(tables, placement, model.device)
        placed[placement] = deepinfer_cases(model, [c for c in cases if c.startswith("decode")], True,
                                            prefill=shape.prefill, context=shape.context, max_seqs=shape.max_seqs,
                                            device=shape.device)
    result = {"format": "released" if released else "bf16", "rows": rows, "weights_bytes": counts.resident,
              "state_bytes": state_bytes, "tokens_per_gib": density, "engram": engram[0]}
    if {"host", "device"} <= placed.keys():
        line, result["engram_host_over_device"] = engram_report(placed)
        print(line + "\n")
    return result


def built_tables(model: Any) -> list[tuple[Any, Any, Any]]:
    """(weights, table, scales or None) of each Engram layer of the slice as built: in device memory."""
    return [(layer.engram.weights, layer.engram.weights.table, layer.engram.weights.table_scale)
            for layer in model.layers if layer.engram is not None]


def place_engram(tables: list[tuple[Any, Any, Any]], placement: str, device: Any) -> None:
    """Point the Engram layers of :func:`built_tables` at their tables (an FP8 table's scales too) in ``placement``:
    ``"device"`` memory, as built, or ``"host"`` memory the kernels read in place (``Backend.host_resident`` of a
    host copy: what the loader's ``engram_placement="host"`` gives)."""
    from deepinfer.models.deepseek_v41.engram_placement import check_placement

    backend = backend_for(device.type)
    for weights, table, scale in tables:
        if check_placement(placement) == "device":
            weights.table, weights.table_scale = table, scale
            continue
        weights.table = backend.host_resident(table.cpu(), device)
        weights.table_scale = None if scale is None else backend.host_resident(scale.cpu(), device)


def engram_report(times: dict[str, dict[str, Any]]) -> tuple[str, dict[str, float]]:
    """The decode cases with the Engram table in host memory against device memory, timed in the same run: a line
    and each case's host / device ratio (replayed steps: the device's time)."""
    host, device = times["host"], times["device"]
    ratios, parts = {}, []
    for case, seconds in device.items():
        if not case.startswith("decode") or not isinstance(seconds, float) or case.endswith("replay"):
            continue
        key = case + " replay" if case + " replay" in device and case + " replay" in host else case
        ratios[case] = host[key] / device[key]
        parts.append(f"{case}: {device[key] * 1e3:.3f} -> {host[key] * 1e3:.3f} ms ({ratios[case] - 1:+.1%})")
    return "Engram table in host memory (UVA) vs device memory, same run: " + "; ".join(parts), ratios


def op_table(tiny: bool) -> Any:
    """Core's reference ops for the tiny slice on the CPU, else the CUDA backend's table."""
    from deepinfer.ops import OpTable

    if tiny:
        return OpTable()
    from deepinfer_cuda.ops import kernels_by_op

    return OpTable(kernels_by_op(), "nvidia")


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--cases", default="prefill,decode1,decode16,decode64")
    parser.add_argument("--eager", action="store_true", help="also time eager decode steps (no graphs)")
    parser.add_argument("--released", action="store_true",
                        help="also run the slice in the released formats, kept as stored (after the bf16 one)")
    parser.add_argument("--tiny", action="store_true", help="a toy config on the CPU with core's reference ops")
    parser.add_argument("--profile", action="store_true", help="also print each case's device time per kernel")
    parser.add_argument("--engram", default="device",
                        help="where the Engram table lives: device, host, or both (device,host: every case with the "
                             "first, then the decode cases with the second, and their ratio)")
    parser.add_argument("--engram-vocab", type=int, help="the Engram table's first prime bucket (rows: ~24x it; "
                                                         "V4.1-Flash: 16000000)")
    args = parser.parse_args(argv)
    engram = tuple(p for p in args.engram.split(",") if p)
    if not engram or len(set(engram)) != len(engram) or not set(engram) <= {"host", "device"}:
        parser.error(f"--engram takes host, device or both, comma-separated; got {args.engram!r}")
    shape = dataclasses.replace(SMALL if args.tiny else FULL, engram_vocab=args.engram_vocab)
    cases = [c for c in args.cases.split(",") if c]
    table = op_table(args.tiny)
    roof = ceilings(shape.device, small=args.tiny, fp8=args.released)
    device = torch.cuda.get_device_name() if shape.device == "cuda" else "cpu"
    slices = []
    for released in (False, True) if args.released else (False,):
        slices.append(run_slice(shape, table, cases, args.eager, released, roof, device, args.profile, engram))
        if shape.device == "cuda":
            torch.cuda.empty_cache()
    if args.released:
        bf16, rel = slices
        def best(r: dict[str, Any]) -> float:
            return min(r["s"], r.get("replay_s", r["s"]))

        speedups = ", ".join(f"{a['case']} {best(a) / best(b):.2f}x" for a, b in zip(bf16["rows"], rel["rows"],
                                                                                     strict=True))
        print(f"released vs bf16: weights {bf16['weights_bytes'] / 1e9:.1f} -> {rel['weights_bytes'] / 1e9:.1f} GB, "
              f"state {bf16['tokens_per_gib']:,.0f} -> {rel['tokens_per_gib']:,.0f} tokens/GiB; faster: {speedups}")
    if shape.device == "cuda":
        print(f"\nkernel launches through Triton JIT (no cubin in the kernel set): {jit_launches() or 'none'}")
    result = {"device": device, "copy_Bps": roof.bandwidth, "bf16_flops": roof.bf16_flops, "fp8_flops": roof.fp8_flops,
              "torch": torch.__version__, "rows": slices[0]["rows"], "slices": slices}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
