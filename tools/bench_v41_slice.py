#!/usr/bin/env python
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

    python tools/bench_v41_slice.py [--json PATH] [--cases prefill,decode1,decode16,decode64] [--eager]
    python tools/bench_v41_slice.py --tiny      # a small config on the CPU (reference ops): tests the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from bench_common import SwitchableOps, deepinfer_cases, measure_ceilings

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


FULL = Shape(SLICE, 384, 1024, 2048, 64, "cuda")
SMALL = Shape(TINY, 16, 64, 80, 64, "cpu")


def _config(shape: Shape):
    from deepinfer.models.deepseek_v41.config import DeepseekV41Config
    from deepinfer.models.deepseek_v41.engram_hash import is_prime

    raw = dict(shape.config)
    # the table holds the buckets: the consecutive primes >= engram_vocab_size, one per (n-gram size, head)
    candidate, rows = raw["engram_vocab_size"] - 1, 0
    for _ in range((raw["engram_max_ngram_size"] - 1) * raw["engram_n_heads"]):
        candidate += 1
        while not is_prime(candidate):
            candidate += 1
        rows += candidate
    raw["engram_num_embeddings"] = [rows]
    return DeepseekV41Config.from_dict(raw)


def build_model(shape: Shape, ops: Any):
    """The slice's model with random weights (N(0, 1/fan_in) matrices, norms 1, fp32 where the loader keeps
    fp32), its MoE layers then pointed at one shared stack of ``shape.experts`` routed experts + the shared one."""
    import torch

    from deepinfer.models.deepseek_v4.weights import keeps_fp32
    from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from deepinfer.models.deepseek_v41.weights import expected_shapes

    cfg = _config(shape)
    device, gen = torch.device(shape.device), torch.Generator(device=shape.device).manual_seed(0)

    def rand(*dims: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        t = torch.randn(*dims, generator=gen, device=device, dtype=dtype)
        return t.mul_(dims[-1] ** -0.5) if len(dims) > 1 else t

    tensors = {}
    for name, dims in expected_shapes(cfg).items():
        dtype = torch.float32 if keeps_fp32(name) or "hc_" in name else torch.bfloat16
        if name.endswith(("norm.weight", "q_weight", "k_weight")):
            tensors[name] = torch.ones(dims, dtype=dtype, device=device)
        elif name.endswith("embed.weight") and name.startswith("layers."):  # an Engram table: O(1) rows
            tensors[name] = torch.randn(*dims, generator=gen, device=device, dtype=dtype)
        else:
            tensors[name] = rand(*dims, dtype=dtype)
    token_map = torch.randint(0, cfg.engram_compressed_vocab_size, (cfg.vocab_size,), generator=gen, device=device)
    model = DeepseekV41ForCausalLM(cfg, tensors, {}, token_map, ops=ops, dtype=torch.bfloat16, device=device)
    del tensors
    e, hidden, inter = shape.experts, cfg.hidden_size, cfg.moe_intermediate_size
    w13, w2 = rand(e + 1, 2 * inter, hidden), rand(e + 1, hidden, inter)
    for layer in model.layers:
        moe = layer.ffn
        moe.w13, moe.w2, moe.shared_id = w13, w2, e
        moe.shared_slot = (torch.full((1, 1), e, dtype=torch.int64, device=device),
                           torch.ones((1, 1), dtype=torch.float32, device=device))
        moe.gate, moe.bias = rand(e, hidden), 0.1 * torch.randn(e, generator=gen, device=device)
        moe.spec = dataclasses.replace(moe.spec, n_routed_experts=e)
    return model


@dataclasses.dataclass(slots=True)
class Bytes:
    """What a step reads, in bytes: ``dense`` once a step, ``expert`` per distinct routed expert a layer hits (and
    its shared expert), ``per_token`` per token (its embedding and Engram rows), ``head`` once (the logits);
    ``dense_params`` / ``expert_params``: the parameters a token multiplies (for the FLOPs)."""

    dense: int
    expert: int
    per_token: int
    head: int
    dense_params: int
    expert_params: int
    layers: int
    experts: int
    top_k: int

    def touched(self, tokens: int) -> tuple[float, float]:
        """(bytes read, FLOPs) of a step over ``tokens`` tokens."""
        hit = self.experts * (1 - (1 - self.top_k / self.experts) ** tokens) + 1  # + the shared expert
        read = self.dense + hit * self.expert * self.layers + tokens * self.per_token + self.head
        per_token = self.dense_params + (self.top_k + 1) * self.expert_params * self.layers
        return read, 2.0 * per_token * tokens


def count_bytes(cfg: Any, shape: Shape) -> Bytes:
    """:class:`Bytes` of the slice from its tensors' names and shapes (``expected_shapes``), with the routers
    and experts at ``shape.experts`` (the model is built with fewer, then shares one stack: see :func:`build_model`)."""
    import math

    from deepinfer.models.deepseek_v4.weights import keeps_fp32
    from deepinfer.models.deepseek_v41.weights import expected_shapes

    dense = dense_params = 0
    for name, dims in expected_shapes(cfg).items():
        n = math.prod(dims)
        if "experts." in name or name in ("embed.weight", "head.weight") or name.endswith("engram.embed.weight"):
            continue  # per expert hit, per token or per sequence: below
        if ".ffn.gate." in name:
            n = n // cfg.n_routed_experts * shape.experts
        dense += n * (4 if keeps_fp32(name) or "hc_" in name else 2)
        dense_params += n
    expert_params = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    engram = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim * len(cfg.engram_layer_ids)
    return Bytes(dense, 2 * expert_params, 2 * (cfg.hidden_size + engram), 2 * cfg.vocab_size * cfg.hidden_size,
                 dense_params, expert_params, cfg.num_hidden_layers, shape.experts, cfg.num_experts_per_tok)


def report(rows: list[dict[str, Any]], counts: Bytes, bw: float, peak: float, device: str) -> str:
    """A markdown table: each case's time, its roofline and the fraction of it reached (prefill: MFU too)."""
    lines = [f"device: {device}; ceilings measured now: copy {bw / 1e12:.3f} TB/s, bf16 matmul {peak / 1e12:.1f} "
             f"TFLOP/s; dense {counts.dense / 1e9:.2f} GB, one expert {counts.expert / 1e6:.1f} MB",
             "", "| case | ms (graph step) | ms (replay) | roofline ms | bound | HBM GB | fraction of roofline |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        read, flops = counts.touched(r["tokens"])
        t_mem, t_math = read / bw, flops / peak
        floor = max(t_mem, t_math)
        best = min(r["s"], r.get("replay_s", r["s"]))
        r.update(floor_s=floor, bound="memory" if t_mem >= t_math else "math", bytes=read, flops=flops,
                 fraction=floor / best)
        replay = f"{r['replay_s'] * 1e3:.2f}" if "replay_s" in r else "-"
        frac = f"{floor / best:.0%}"
        if r["case"].startswith("prefill"):
            frac += f" (MFU {r['flops'] / best / peak:.0%})"
        lines.append(f"| {r['case']} | {r['s'] * 1e3:.2f} | {replay} | {floor * 1e3:.3f} | {r['bound']} | "
                     f"{read / 1e9:.2f} | {frac} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--cases", default="prefill,decode1,decode16,decode64")
    parser.add_argument("--eager", action="store_true", help="also time eager decode steps (no graphs)")
    parser.add_argument("--tiny", action="store_true", help="a toy config on the CPU with core's reference ops")
    args = parser.parse_args(argv)
    shape = SMALL if args.tiny else FULL
    cases = [c for c in args.cases.split(",") if c]
    if args.tiny:
        from deepinfer.ops import OpTable

        table: Any = OpTable()
    else:
        from deepinfer.ops import OpTable
        from deepinfer_cuda.ops import OVERRIDES

        table = OpTable(OVERRIDES, "nvidia")
    bw, peak = measure_ceilings(shape.device, small=args.tiny)
    model = build_model(shape, SwitchableOps(table))
    counts = count_bytes(model.config, shape)
    model.configure_state(shape.max_seqs, model.state_pool_bytes(shape.max_seqs, max(shape.prefill,
                                                                                      shape.context + 64)))
    variants = {"graphs": True, "eager": False} if args.eager else {"graphs": True}
    times = {v: deepinfer_cases(model, cases, graphs, prefill=shape.prefill, context=shape.context,
                                max_seqs=shape.max_seqs, device=shape.device) for v, graphs in variants.items()}
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
    device = torch.cuda.get_device_name() if shape.device == "cuda" else "cpu"
    print(report(rows, counts, bw, peak, device))
    if shape.device == "cuda":
        from deepinfer_cuda.kernel_set.dispatch import _KERNELS

        jit = {k.name: k.launch_counts["jit"] for k in _KERNELS if k.launch_counts["jit"]}
        print(f"\nkernel launches through Triton JIT (no cubin in the kernel set): {jit or 'none'}")
    result = {"device": device, "copy_Bps": bw, "bf16_flops": peak, "torch": torch.__version__, "rows": rows}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
