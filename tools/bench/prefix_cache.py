"""Prefill time saved by prefix caching: ``--concurrency`` requests that share a ``--prefix``-token system prompt.

Per mode (cache off, cache on): one warm-up request (the shared prefix and a suffix of its own: it warms the code
paths and, with the cache on, publishes the prefix), then the timed batch of requests with distinct suffixes,
each generating ``--max-tokens`` tokens (1: the time is the prefill).  Prints the median wall time of each mode
over ``--repeats`` batches (each timed batch in a fresh engine), the tokens served from the cache, the replay a
hit costs, and the largest logprob difference between the modes (the cache is exact: rounding only).

``--slice``: the V4.1-Flash slice of ``tools.bench.v41_slice`` (8 layers at V4.1-Flash's dims, 384 experts,
bf16 random weights) on the GPU, built once and served by each mode's fresh engine (``LLM.from_model``); its
state cache holds ``--concurrency`` + 1 sequences of prefix + suffix tokens.  A hit replays
``layers x (window - 1) + n-gram history`` tokens before it (1020 on the slice), so the default prefix there is
4096 tokens.  ``--slice --tiny``: the same on the CPU at toy dims (tests the script).

    python -m tools.bench.prefix_cache                     # the embedded tiny V4.1 on the CPU, fp32
    python -m tools.bench.prefix_cache --device cuda --model /path/to/checkpoint --dtype bfloat16
    python -m tools.bench.prefix_cache --slice             # the V4.1-Flash slice on the GPU, bf16
    python -m tools.bench.prefix_cache --slice --tiny      # the slice at toy dims on the CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

#: Default shared prompt tokens: (embedded model or checkpoint, the slice, the tiny slice).
PREFIX = {"model": 2048, "slice": 4096, "tiny": 256}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny V4.1)")
    p.add_argument("--slice", action="store_true", help="the V4.1-Flash slice with random weights (no checkpoint)")
    p.add_argument("--tiny", action="store_true", help="with --slice: the slice at toy dims on the CPU")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cpu (--slice: cuda, --slice --tiny: cpu)")
    p.add_argument("--dtype", default="float32", help="checkpoint mode only (the slice is bf16)")
    p.add_argument("--prefix", type=int, default=None,
                   help=f"shared prompt tokens (default {PREFIX['model']}; --slice {PREFIX['slice']}, "
                        f"--slice --tiny {PREFIX['tiny']})")
    p.add_argument("--suffix", type=int, default=32, help="distinct tokens after the prefix, per request")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--state-cache-bytes", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: the engine's, 8192; 0: every prompt whole in one step)")
    args = p.parse_args(argv)
    if args.tiny and not args.slice:
        p.error("--tiny goes with --slice")
    if args.slice and args.model:
        p.error("--slice builds its model: no --model")
    slice_device = "cpu" if args.tiny else "cuda"
    if args.slice and args.device not in (None, slice_device):
        p.error(f"the {'tiny ' if args.tiny else ''}slice runs on {slice_device}"
                + ("" if args.tiny else " (--tiny: the CPU toy)"))
    args.device = args.device or (slice_device if args.slice else "cpu")
    if args.prefix is None:
        args.prefix = PREFIX["tiny" if args.tiny else "slice" if args.slice else "model"]
    return args


def _prompts(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[int]]]:
    import torch

    g = torch.Generator().manual_seed(0)
    shared = torch.randint(5, vocab - 1, (args.prefix,), generator=g).tolist()
    warm = shared + torch.randint(5, vocab - 1, (args.suffix,), generator=g).tolist()
    batch = [shared + torch.randint(5, vocab - 1, (args.suffix,), generator=g).tolist()
             for _ in range(args.concurrency)]
    return warm, batch


def _engine(args: argparse.Namespace, caching: bool, model: Any) -> Any:
    """A fresh engine: over the built ``model`` (the slice), else loading ``--model``."""
    kw: dict = {"state_cache_bytes": args.state_cache_bytes} if args.state_cache_bytes else {}
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens or (args.prefix + args.suffix) * args.concurrency
    seqs = max(args.concurrency, 1)
    if model is None:
        from deepinfer import LLM

        return LLM(args.model, dtype=args.dtype, enable_prefix_caching=caching, max_num_seqs=seqs, **kw)
    from tools.bench.v41_slice_engine import slice_llm

    # every request of the batch and the warm-up one, whole (cache off: nothing shared)
    kw.setdefault("state_cache_bytes", model.state_pool_bytes(seqs + 1, args.prefix + args.suffix + args.max_tokens))
    return slice_llm(model, enable_prefix_caching=caching, max_num_seqs=seqs, **kw)


def _run(args: argparse.Namespace, caching: bool, model: Any = None) -> tuple[float, list, Any]:
    """(wall seconds of the timed batch, its outputs, the engine's model) in a fresh engine."""
    from deepinfer import SamplingParams

    llm = _engine(args, caching, model)
    warm, batch = _prompts(args, llm.engine.model.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
    if args.device == "cuda":
        import torch

        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return time.perf_counter() - start, outs, llm.engine.model


def replay_line(model: Any, hit: int, prompt: int) -> str:
    """What a hit of ``hit`` cached tokens computes of a ``prompt``-token request (the model's bounded replay)."""
    lookback = getattr(model, "replay_lookback", None)
    if lookback is None:
        return "replay: this model has no bounded replay"
    cfg = model.config
    history = lookback - cfg.num_hidden_layers * (cfg.sliding_window - 1)
    line = (f"replay lookback {lookback} tokens ({cfg.num_hidden_layers} layers x (window {cfg.sliding_window} - 1) "
            f"+ {history} n-gram history)")
    if not hit:
        return line + f"; no hit: the prefix ({prompt} tokens with the suffix) is too short for a hit to save work"
    start = model.replay_start(hit, prompt - 1)
    return (line + f"; a hit of {hit} tokens computes from position {start}: {prompt - start} of each request's "
            f"{prompt} prompt tokens ({prompt / (prompt - start):.1f}x fewer)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _args(argv)
    os.environ.setdefault("DEEPINFER_ACCELERATOR", "nvidia" if args.device == "cuda" else "cpu")
    model, name = None, args.model or "embedded tiny V4.1"
    if args.slice:
        from tools.bench.v41_slice_engine import build_slice, describe

        began = time.perf_counter()
        model = build_slice(args.tiny)
        name = describe(model)
        print(f"built the slice in {time.perf_counter() - began:.1f} s", flush=True)
    times: dict[bool, list[float]] = {False: [], True: []}
    outs: dict[bool, list] = {}
    for _ in range(args.repeats):
        for caching in (False, True):
            seconds, outs[caching], engine_model = _run(args, caching, model)
            times[caching].append(seconds)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    cached = sum(o.num_cached_tokens for o in outs[True])
    prompt = sum(len(o.prompt_token_ids) for o in outs[True])
    # bf16 on a GPU: a hit computes in other batch shapes than scratch, so near-tied tokens (random weights) may
    # differ; the logprob difference is over the positions where both drew the same token
    pairs = [(a.outputs[0], b.outputs[0]) for a, b in zip(outs[False], outs[True], strict=True)]
    diff = max((abs(a.logprobs[i][t].logprob - b.logprobs[i][t].logprob) for a, b in pairs
                for i, (t, u) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if t == u), default=0.0)
    agree = sum(a.token_ids == b.token_ids for a, b in pairs)
    same = agree == len(pairs)
    dtype = str(model.dtype).removeprefix("torch.") if model is not None else args.dtype
    print(f"model={name} device={args.device} dtype={dtype} prefix={args.prefix} "
          f"suffix={args.suffix} concurrency={args.concurrency} max_tokens={args.max_tokens} repeats={args.repeats} "
          f"max_num_batched_tokens={args.max_num_batched_tokens or 'engine default'}")
    print(replay_line(engine_model, outs[True][0].num_cached_tokens, len(outs[True][0].prompt_token_ids)))
    print(f"cache off: {off * 1e3:.1f} ms   cache on: {on * 1e3:.1f} ms   saved {(1 - on / off) * 100:.1f}% "
          f"({off / on:.2f}x)")
    print(f"prompt tokens {prompt}, served from the cache {cached} ({cached / prompt * 100:.1f}%); "
          f"same tokens: {agree} of {len(pairs)} requests; max |logprob difference| {diff:.3g}")
    if model is not None:
        from tools.bench.v41_slice_engine import check_shared_stack, jit_line

        print(check_shared_stack(model))
        if jit_line(model):
            print(jit_line(model))
    return {"off_s": off, "on_s": on, "cached": cached, "prompt": prompt, "same": same, "max_diff": diff}


if __name__ == "__main__":
    main()
