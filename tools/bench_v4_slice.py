#!/usr/bin/env python
"""Benchmark the DeepSeek-V4-Flash slice on one GPU: HF transformers (baseline) against the roofline.

The slice: hidden 4096, 64 heads x 512, q_lora 1024, o_groups 8 x 1024, 64 routed experts top-6 + 1 shared of
2048, vocab 129280, sliding window 128, indexer 64 x 128 top-512, 8 layers with the released pattern (2 SWA,
then CSA / HCA alternating; the first 3 MoE layers hash-routed), bf16, random weights.

Cases: prefill 1 x 1024 tokens; decode steps at batch 1 / 16 / 64 after 512 tokens of context per sequence.
The roofline of each case is max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured in the same
run: bytes = every weight the step touches once (routed experts: the expected number of distinct experts hit),
FLOPs = 2 x touched-per-token parameters x tokens (attention-score FLOPs are left out: small at this context).

    python tools/bench_v4_slice.py [--json PATH] [--cases prefill,decode1,decode16,decode64]

DeepInfer's own engine joins this table once the V4 model runs through the engine on the GPU (see
docs/performance.md).  Needs transformers >= 5.24 (DeepseekV4ForCausalLM).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

SLICE = dict(
    vocab_size=129280, hidden_size=4096, num_hidden_layers=8, num_attention_heads=64, num_key_value_heads=1,
    head_dim=512, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=64, num_experts_per_tok=6,
    n_shared_experts=1, moe_intermediate_size=2048, sliding_window=128, index_n_heads=64, index_head_dim=128,
    index_topk=512, compress_ratios=[0, 0, 4, 128, 4, 128, 4, 128], num_hash_layers=3, num_nextn_predict_layers=0,
)
CONTEXT = 512
PREFILL = 1024
DEVICE = "cuda"


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` (synchronised), after one warm-up call."""
    fn()
    _sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_ceilings() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s), on random data."""
    import torch
    from triton.testing import do_bench

    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 2 / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flops = 2 * 8192**3 / (do_bench(lambda: a @ b, return_mode="median") * 1e-3)
    return bw, flops


class ParamCounts:
    """Parameter counts of the HF model, split so a step's touched bytes and FLOPs can be counted."""

    def __init__(self, model, n_experts: int):
        self.embed = self.experts = self.other = 0
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                self.embed += p.numel()
            elif ".experts." in name or name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
                self.experts += p.numel()
            else:
                self.other += p.numel()
        self.n_experts = n_experts

    def touched(self, tokens: int, top_k: int, moe_layers: int) -> tuple[float, float]:
        """(parameters read once, parameters multiplied per token) for a step over ``tokens`` tokens."""
        per_expert = self.experts / (self.n_experts * moe_layers)
        hit = self.n_experts * (1 - (1 - top_k / self.n_experts) ** tokens)  # expected distinct experts per layer
        read = self.other + hit * per_expert * moe_layers + tokens * self.embed / SLICE["vocab_size"]
        per_token = self.other + top_k * per_expert * moe_layers
        return read, per_token


def hf_cases(cases: list[str]) -> tuple[list[dict[str, object]], ParamCounts]:
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(**SLICE)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEVICE):
        model = DeepseekV4ForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    counts = ParamCounts(model, cfg.n_routed_experts)
    vocab = cfg.vocab_size
    rows = []
    with torch.inference_mode():
        if "prefill" in cases:
            ids = torch.randint(0, vocab, (1, PREFILL), device=DEVICE)
            t = _time(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), repeats=3)
            rows.append({"case": f"prefill 1x{PREFILL}", "tokens": PREFILL, "hf_s": t})
        for case in cases:
            if not case.startswith("decode"):
                continue
            batch = int(case[len("decode"):])
            ids = torch.randint(0, vocab, (batch, CONTEXT), device=DEVICE)
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
            step_ids = torch.randint(0, vocab, (batch, 1), device=DEVICE)
            steps = []
            for _ in range(6):
                _sync()
                start = time.perf_counter()
                out = model(input_ids=step_ids, cache=cache, use_cache=True)
                _sync()
                steps.append(time.perf_counter() - start)
                cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
            rows.append({"case": f"decode b{batch} ctx {CONTEXT}", "tokens": batch,
                         "hf_s": statistics.median(steps[1:])})
            del cache, out
            torch.cuda.empty_cache()
    return rows, counts


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--cases", default="prefill,decode1,decode16,decode64")
    args = parser.parse_args(argv)
    bw, peak = measure_ceilings()
    rows, counts = hf_cases(args.cases.split(","))
    moe_layers = SLICE["num_hidden_layers"]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  transformers {transformers.__version__}")
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s; params: "
          f"{counts.other / 1e9:.2f}B dense + {counts.experts / 1e9:.2f}B experts + {counts.embed / 1e9:.2f}B embed")
    print(f"{'case':24} {'HF ms':>9} {'floor ms':>9} {'bound':>6} {'HF/floor':>9} {'tok/s HF':>9}")
    for r in rows:
        read, per_token = counts.touched(r["tokens"], SLICE["num_experts_per_tok"], moe_layers)
        t_mem, t_math = 2 * read / bw, 2 * per_token * r["tokens"] / peak
        floor = max(t_mem, t_math)
        r.update(floor_s=floor, bound="memory" if t_mem >= t_math else "math", bytes=2 * read,
                 flops=2 * per_token * r["tokens"])
        print(f"{r['case']:24} {r['hf_s'] * 1e3:9.2f} {floor * 1e3:9.3f} {r['bound']:>6} "
              f"{r['hf_s'] / floor:8.1f}x {r['tokens'] / r['hf_s']:9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_Bps": bw, "bf16_flops": peak,
                       "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
