"""Benchmark the DeepSeek-V4-Flash slice on one GPU: HF transformers (baseline) against the roofline.

The slice: hidden 4096, 64 heads x 512, q_lora 1024, o_groups 8 x 1024, 64 routed experts top-6 + 1 shared of
2048, vocab 129280, sliding window 128, indexer 64 x 128 top-512, 8 layers with the released pattern (2 SWA,
then CSA / HCA alternating; the first 3 MoE layers hash-routed), bf16, random weights.

Cases: prefill 1 x 1024 tokens; decode steps at batch 1 / 16 / 64 after 512 tokens of context per sequence.
The roofline of each case is max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured in the same
run: bytes = every weight the step touches once (routed experts: the expected number of distinct experts hit),
FLOPs = 2 x touched-per-token parameters x tokens (attention-score FLOPs are left out: small at this context).

DeepInfer runs the same random weights (HF's parameters, renamed to the released checkpoint's names the way
``save_pretrained`` does, without a round trip through disk) through ``DeepseekV4ForCausalLM.forward`` in bf16,
once per op table of ``--variants``: ``nvidia`` (every CUDA override), ``nvidia-no-moe`` (the same without the
MoE expert kernel: core's per-expert loop), ``reference`` (core's plain-PyTorch ops on the GPU); decode steps
are replayed from CUDA graphs captured per batch size (``runner/decode_graphs.py``, as the engine does), or run
eagerly for a variant named with ``-eager`` (``nvidia-eager``).  A step is the
model forward plus the logits of each sequence's last row, as for HF; hash-routing tables are randomised (HF's
init leaves them zero, which sends every token of the first layers to expert 0).  The prefill is also captured in
a CUDA graph once, as a measurement only (the engine runs prefill steps eagerly): its replay is the prefill's
device time without the host's launches in the way.  ``--profile DIR`` also writes a
torch.profiler tables of one decode step (batch 16) and one prefill (nvidia ops), by CUDA and by CPU time.

    python -m tools.bench.v4_slice [--json PATH] [--cases prefill,decode1,decode16,decode64]
                                   [--variants nvidia,nvidia-eager] [--profile DIR] [--no-hf]
                                   [--engine 1,16,64] [--mixed 63] [--sync-trace]

``--mixed N`` times one continuous-batching mixed step (a prefill chunk beside N decode rows, the ragged path).
``--engine`` also times decode steps through ``LLM.generate`` (scheduler, graphs, sampler, output processing) with
async scheduling on and off.  ``--sync-trace`` prints each host synchronisation of one prefill and where it comes
from.

Needs transformers >= 5.24 (DeepseekV4ForCausalLM).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

from tools.bench.steps import (
    SwitchableOps,
    deepinfer_cases,
    di_decode_step,
    di_prefill,
    di_prefill_once,
    di_step,
    jit_launches,
)
from tools.ceilings import ceilings
from tools.timing import queue_time, sync, time_median

SLICE = dict(
    vocab_size=129280, hidden_size=4096, num_hidden_layers=8, num_attention_heads=64, num_key_value_heads=1,
    head_dim=512, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=64, num_experts_per_tok=6,
    n_shared_experts=1, moe_intermediate_size=2048, sliding_window=128, index_n_heads=64, index_head_dim=128,
    index_topk=512, compress_ratios=[0, 0, 4, 128, 4, 128, 4, 128], num_hash_layers=3, num_nextn_predict_layers=0,
)
CONTEXT = 512
PREFILL = 1024
MAX_SEQS = 64  # the state pool's sequence slots (the largest decode batch)
DEVICE = "cuda"


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


def build_hf(device: str):
    """The HF slice model in bf16 on ``device`` with its hash-routing tables randomised."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(**SLICE)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = DeepseekV4ForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):  # k distinct experts per token id
                noise = torch.rand(buf.shape[0], cfg.n_routed_experts, device=device, generator=gen)
                buf.copy_(noise.argsort(dim=1)[:, : buf.shape[1]])
    return model


def hf_cases(model, cases: list[str]) -> list[dict[str, object]]:
    import torch

    vocab = model.config.vocab_size
    rows = []
    with torch.inference_mode():
        if "prefill" in cases:
            ids = torch.randint(0, vocab, (1, PREFILL), device=DEVICE)
            t = time_median(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), repeats=3)
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
                sync()
                start = time.perf_counter()
                out = model(input_ids=step_ids, cache=cache, use_cache=True)
                sync()
                steps.append(time.perf_counter() - start)
                cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
            rows.append({"case": f"decode b{batch} ctx {CONTEXT}", "tokens": batch,
                         "hf_s": statistics.median(steps[1:])})
            del cache, out
            torch.cuda.empty_cache()
    return rows


def op_tables() -> dict[str, object]:
    """The op tables of ``--variants`` by name."""
    from deepinfer.ops import OpTable
    from deepinfer_cuda.ops import kernels_by_op

    kernels = kernels_by_op()
    return {
        "nvidia": OpTable(kernels, "nvidia"),
        "nvidia-no-moe": OpTable({k: v for k, v in kernels.items() if k != "moe_experts"}, "nvidia"),
        "reference": OpTable(),
    }


def deepinfer_from_hf(hf_model, ops, dtype, device):
    """DeepInfer's V4 model over the HF model's own parameters: renamed to the released names as
    ``save_pretrained`` does (transformers' ``revert_weight_conversion``), fp32 where the loader keeps fp32."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    from deepinfer.models.deepseek_v4 import DeepseekV4Config as V4Config
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM as V4Model
    from deepinfer.models.deepseek_v4.weights import V4Weights, expected_shapes
    from deepinfer.models.weight_reader import canonical_name, keeps_fp32

    cfg = V4Config.from_dict(hf_model.config.to_dict())
    released = revert_weight_conversion(hf_model, dict(hf_model.state_dict()))
    tensors = {}
    for raw, t in released.items():
        name = canonical_name(raw)
        if not t.is_floating_point():
            tensors[name] = t.long()
        else:
            tensors[name] = t.to(torch.float32 if keeps_fp32(name) else dtype)
    if cfg.tie_word_embeddings:
        tensors.pop("head.weight", None)
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise KeyError(f"HF state dict lacks {missing[:5]} ({len(missing)} in all)")
    tensors = {n: tensors[n] for n in expected}
    assert all(tuple(tensors[n].shape) == s for n, s in expected.items())
    return V4Model(cfg, V4Weights(tensors), ops=ops, dtype=dtype, device=torch.device(device))


def _profiled(step, name: str, directory: str) -> str:
    """Run ``step`` once under torch.profiler; write the CPU- and CUDA-sorted tables to ``directory/name.txt``
    and return a summary line plus the CUDA-sorted table."""
    import os

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(directory, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    averages = prof.key_averages()
    by_cuda = averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)
    by_cpu = averages.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60)
    with open(os.path.join(directory, f"{name}.txt"), "w") as f:
        f.write("# sorted by self CUDA time\n" + by_cuda + "\n# sorted by total CPU time\n" + by_cpu)

    def count(pred: Callable[[str], bool]) -> int:
        return sum(e.count for e in averages if pred(e.key))

    launches = count(lambda k: k in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    syncs = count(lambda k: k in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"))
    to_host = count(lambda k: k.startswith("Memcpy DtoH"))
    return f"{name}: kernel launches {launches}, host syncs {syncs}, device->host copies {to_host}\n" + by_cuda


def profile_steps(model, batch: int, directory: str) -> str:
    """Profiles of one decode step at ``batch`` (replayed from a CUDA graph, after two warm-up steps) and of
    one 1 x PREFILL prefill."""
    import torch

    from deepinfer.runner.decode_graphs import DecodeGraphs
    from deepinfer_cuda.plugin import CudaBackend

    with torch.inference_mode():
        states = di_prefill(model, torch.randint(0, model.vocab_size, (batch, CONTEXT), device=DEVICE))

        graphs = DecodeGraphs(model, CudaBackend(), torch.device(DEVICE), MAX_SEQS, CONTEXT + 64)
        di_decode_step(model, states, graphs, DEVICE)
        di_decode_step(model, states, graphs, DEVICE)
        sync()
        decode = _profiled(lambda: di_decode_step(model, states, graphs, DEVICE), f"profile_decode_b{batch}", directory)
        for state in states:
            state.release()
        graphs.close()
        ids = torch.randint(0, model.vocab_size, (PREFILL,), device=DEVICE)
        pos = torch.arange(PREFILL, device=DEVICE)
        prefill = _profiled(lambda: di_prefill_once(model, ids, pos), "profile_prefill", directory)
    return decode + "\n" + "\n".join(prefill.splitlines()[:18])


def sync_trace(model) -> str:
    """Where a prefill of ``PREFILL`` tokens waits for the device: each host synchronisation that
    ``torch.cuda.set_sync_debug_mode`` reports, with the DeepInfer frames that led to it."""
    import traceback
    import warnings

    import torch

    ids = torch.randint(0, model.vocab_size, (PREFILL,), device=DEVICE)
    pos = torch.arange(PREFILL, device=DEVICE)
    di_prefill_once(model, ids, pos)  # warm: allocations, first launches
    sync()
    seen: list[str] = []

    def record(message, *_args, **_kwargs):
        if "synchronizing" not in str(message):  # e.g. the debug mode's own "prototype feature" notice
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "deepinfer" in f.filename or "bench_v4" in f.filename]
        seen.append(f"{message}\n" + "".join(traceback.format_list(frames[-4:])))

    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            di_prefill_once(model, ids, pos)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return f"host syncs in one prefill of {PREFILL} tokens: {len(seen)}\n" + "\n".join(seen)


def mixed_step(model, decode_rows: int) -> dict[str, float]:
    """Milliseconds of a continuous-batching mixed step (eager, ragged): a fresh sequence's ``PREFILL``-token chunk
    beside ``decode_rows`` sequences decoding one token each after ``CONTEXT`` tokens; wall and host queueing time
    (medians of 3).  The decode rows advance by one token per call."""
    import torch

    from deepinfer_cuda.plugin import CudaBackend

    upload = CudaBackend().to_device
    with torch.inference_mode():
        states = di_prefill(model, torch.randint(0, model.vocab_size, (decode_rows, CONTEXT), device=DEVICE))

        def step():
            fresh = model.new_state()
            try:
                ids = torch.randint(0, model.vocab_size, (decode_rows + PREFILL,), device=DEVICE)
                positions = upload(torch.tensor([s.num_tokens for s in states] + list(range(PREFILL))), ids.device)
                di_step(model, ids, positions, [1] * decode_rows + [PREFILL], states + [fresh])
            finally:
                fresh.release()

        wall, queued = time_median(step, 3), queue_time(step, 3)
        for state in states:
            state.release()
    return {"wall": wall * 1e3, "queued": queued * 1e3}


def engine_decode(model, ops, batch: int, new_tokens: int = 49, repeats: int = 3) -> dict[str, str]:
    """Milliseconds per decode step of ``batch`` requests through ``LLM.generate`` (the whole engine: scheduler,
    graphs, sampler, output processing), with async scheduling on and off: (time of ``new_tokens`` tokens -
    time of 1 token) / (new_tokens - 1), so the prefill cancels out; the median of ``repeats`` such pairs, with
    their range (one pair of 33 tokens spread by +-30% on the H200).  The whole prompt batch is one prefill step
    (``max_num_batched_tokens``): with smaller chunks the first sequences decode beside the later ones' prefill
    and the 1-token and ``new_tokens`` runs no longer share their prefill steps."""
    import torch

    from deepinfer import LLM, SamplingParams
    from deepinfer_cuda.plugin import CudaBackend

    prompts = torch.randint(0, model.vocab_size, (batch, CONTEXT)).tolist()
    out = {}
    for mode in (True, False):
        llm = LLM.from_model(model, None, ops=ops, backend=CudaBackend(), max_num_seqs=MAX_SEQS,
                             max_model_len=CONTEXT + 64, async_scheduling=mode,
                             max_num_batched_tokens=batch * CONTEXT,
                             state_cache_bytes=model.state_pool_bytes(MAX_SEQS, CONTEXT + 64))
        per_step = []
        for rep in range(repeats + 1):  # the first pair warms up (captures the decode graphs)
            times = {}
            for n in (1, new_tokens):
                # sampled, not greedy: a random model's greedy tokens repeat, which sends the hash-routed layers'
                # tokens to few experts and flatters the MoE (random ids, as in the timed steps above, do not)
                params = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=7 + rep)
                sync()
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                sync()
                times[n] = time.perf_counter() - start
            if rep:
                per_step.append((times[new_tokens] - times[1]) / (new_tokens - 1) * 1e3)
        out["async" if mode else "sequential"] = \
            f"{statistics.median(per_step):.2f} ({min(per_step):.2f}-{max(per_step):.2f})"
        del llm
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--cases", default="prefill,decode1,decode16,decode64")
    parser.add_argument("--variants", default="nvidia,nvidia-eager",
                        help="DeepInfer op tables to time (empty: HF only)")
    parser.add_argument("--profile", help="write a profile of one decode step (nvidia) to this directory")
    parser.add_argument("--profile-batch", type=int, default=16, help="batch of the profiled decode step")
    parser.add_argument("--no-hf", action="store_true", help="skip HF's timings (DeepInfer still uses its weights)")
    parser.add_argument("--sync-trace", action="store_true", help="print where a prefill synchronises the host")
    parser.add_argument("--engine", default="", help="decode batches to time through LLM.generate (e.g. 1,16,64)")
    parser.add_argument("--mixed", type=int, default=0,
                        help=f"time a mixed step: a {PREFILL}-token prefill chunk beside this many decode rows (<= 63)")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    variants = [v for v in args.variants.split(",") if v]
    roof = ceilings()
    bw, peak = roof.bandwidth, roof.bf16_flops
    hf = build_hf(DEVICE)
    counts = ParamCounts(hf, SLICE["n_routed_experts"])
    rows = hf_cases(hf, cases) if not args.no_hf else [
        {"case": c, "tokens": n, "hf_s": float("nan")}
        for c, n in ([(f"prefill 1x{PREFILL}", PREFILL)] if "prefill" in cases else [])
        + [(f"decode b{c[6:]} ctx {CONTEXT}", int(c[6:])) for c in cases if c.startswith("decode")]]
    profile_text, engine_rows, mixed = None, {}, None
    if variants or args.profile or args.engine or args.sync_trace or args.mixed:
        tables = op_tables()
        ops = SwitchableOps(tables["nvidia"])
        model = deepinfer_from_hf(hf, ops, torch.bfloat16, DEVICE)
        del hf
        torch.cuda.empty_cache()
        model.configure_state(MAX_SEQS, model.state_pool_bytes(MAX_SEQS, max(PREFILL, CONTEXT + 64)))
        for variant in variants:
            ops.table = tables[variant.removesuffix("-eager")]
            times = deepinfer_cases(model, cases, not variant.endswith("-eager"), prefill=PREFILL, context=CONTEXT,
                                    max_seqs=MAX_SEQS, device=DEVICE)
            for r in rows:
                r[f"di_{variant}_s"] = times[r["case"]]
                if r["case"] + " replay" in times:
                    r[f"di_{variant}_replay_s"] = times[r["case"] + " replay"]
                if r["case"] + " host" in times:
                    r[f"di_{variant}_host_s"] = times[r["case"] + " host"]
            print(f"timed DeepInfer [{variant}]", flush=True)
        if args.sync_trace:
            ops.table = tables["nvidia"]
            print(sync_trace(model), flush=True)
        if args.profile:
            ops.table = tables["nvidia"]
            profile_text = profile_steps(model, args.profile_batch, args.profile)
        for batch in [int(b) for b in args.engine.split(",") if b]:
            ops.table = tables["nvidia"]
            engine_rows[batch] = engine_decode(model, ops, batch)
        if args.mixed:
            ops.table = tables["nvidia"]
            mixed = mixed_step(model, min(args.mixed, MAX_SEQS - 1))
    report(rows, counts, bw, peak, variants)
    if mixed is not None:
        print(f"mixed step (1 x {PREFILL} prefill + {min(args.mixed, MAX_SEQS - 1)} decode rows, eager): "
              f"{mixed['wall']:.2f} ms, queued {mixed['queued']:.2f} ms")
    for batch, ms in engine_rows.items():
        print(f"engine decode b{batch} (LLM.generate, ms per step, median (range)): "
              + ", ".join(f"{k} {v}" for k, v in ms.items()))
    if variants or args.engine:
        print(f"kernel launches through Triton JIT (no cubin in the kernel set): {jit_launches() or 'none'}")
    if profile_text:
        print("\nprofiles (nvidia ops):\n" + profile_text)
    if args.json:
        import transformers

        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_Bps": bw, "bf16_flops": peak,
                       "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows}, f, indent=1)
    return 0


def report(rows, counts: ParamCounts, bw: float, peak: float, variants: list[str]) -> None:
    import torch
    import transformers

    moe_layers = SLICE["num_hidden_layers"]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  transformers {transformers.__version__}")
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s; params: "
          f"{counts.other / 1e9:.2f}B dense + {counts.experts / 1e9:.2f}B experts + {counts.embed / 1e9:.2f}B embed")
    head = f"{'case':22} {'floor ms':>8} {'bound':>6} {'HF ms':>8}" + "".join(f" {v + ' ms':>18}" for v in variants)
    print(head + "  best/floor  tok/s best")
    for r in rows:
        read, per_token = counts.touched(r["tokens"], SLICE["num_experts_per_tok"], moe_layers)
        t_mem, t_math = 2 * read / bw, 2 * per_token * r["tokens"] / peak
        floor = max(t_mem, t_math)
        r.update(floor_s=floor, bound="memory" if t_mem >= t_math else "math", bytes=2 * read,
                 flops=2 * per_token * r["tokens"])
        ours = [r[f"di_{v}_s"] for v in variants]
        best = min(ours) if ours else r["hf_s"]
        line = f"{r['case']:22} {floor * 1e3:8.3f} {r['bound']:>6} {r['hf_s'] * 1e3:8.2f}"
        line += "".join(f" {t * 1e3:18.2f}" for t in ours)
        print(line + f"  {best / floor:9.1f}x {r['tokens'] / best:10.0f}")
        if r["case"].startswith("prefill") and ours:
            print(f"{'':22} MFU of the best: {r['flops'] / best / peak:.1%} (of the measured matmul rate)")
        replays = [f"{v}: {r[f'di_{v}_replay_s'] * 1e3:.2f} ms" for v in variants if f"di_{v}_replay_s" in r]
        if replays:
            print(f"{'':22} graph replay alone (device time of the step): " + ", ".join(replays))
            if r["case"].startswith("prefill"):
                mfu = [f"{v}: {r['flops'] / r[f'di_{v}_replay_s'] / peak:.1%}"
                       for v in variants if f"di_{v}_replay_s" in r]
                print(f"{'':22} MFU of the replay: " + ", ".join(mfu))
        for v in variants:
            if f"di_{v}_host_s" in r:
                host = r[f"di_{v}_host_s"]
                print(f"{'':22} {v} host per step: " + ", ".join(f"{k} {t * 1e3:.3f} ms" for k, t in host.items()))


if __name__ == "__main__":
    sys.exit(main())
