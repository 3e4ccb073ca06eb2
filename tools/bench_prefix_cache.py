"""Prefill time saved by prefix caching: ``--concurrency`` requests that share a ``--prefix``-token system prompt.

Per mode (cache off, cache on): one warm-up request (the shared prefix and a suffix of its own: it warms the code
paths and, with the cache on, publishes the prefix), then the timed batch of requests with distinct suffixes,
each generating ``--max-tokens`` tokens (1: the time is the prefill).  Prints the median wall time of each mode
over ``--repeats`` batches (each timed batch in a fresh engine), the tokens served from the cache, and the
largest logprob difference between the modes (the cache is exact: rounding only).

    python tools/bench_prefix_cache.py                     # the embedded tiny V4.1 on the CPU, fp32
    python tools/bench_prefix_cache.py --device cuda --model /path/to/checkpoint --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny V4.1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefix", type=int, default=2048, help="shared prompt tokens")
    p.add_argument("--suffix", type=int, default=32, help="distinct tokens after the prefix, per request")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--state-cache-bytes", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: the engine's, 8192; 0: every prompt whole in one step)")
    return p.parse_args()


def _prompts(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[int]]]:
    import torch

    g = torch.Generator().manual_seed(0)
    shared = torch.randint(5, vocab - 1, (args.prefix,), generator=g).tolist()
    warm = shared + torch.randint(5, vocab - 1, (args.suffix,), generator=g).tolist()
    batch = [shared + torch.randint(5, vocab - 1, (args.suffix,), generator=g).tolist()
             for _ in range(args.concurrency)]
    return warm, batch


def _run(args: argparse.Namespace, caching: bool) -> tuple[float, list]:
    """(wall seconds of the timed batch, its outputs) in a fresh engine."""
    from deepinfer import LLM, SamplingParams

    kw: dict = {"state_cache_bytes": args.state_cache_bytes} if args.state_cache_bytes else {}
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens or (args.prefix + args.suffix) * args.concurrency
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=caching, max_num_seqs=max(args.concurrency, 1),
              **kw)
    warm, batch = _prompts(args, llm.engine.model.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return time.perf_counter() - start, outs


def main() -> None:
    args = _args()
    if args.device == "cuda":
        os.environ.setdefault("DEEPINFER_ACCELERATOR", "nvidia")
    else:
        os.environ.setdefault("DEEPINFER_ACCELERATOR", "cpu")
    times: dict[bool, list[float]] = {False: [], True: []}
    outs: dict[bool, list] = {}
    for _ in range(args.repeats):
        for caching in (False, True):
            seconds, outs[caching] = _run(args, caching)
            times[caching].append(seconds)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    cached = sum(o.num_cached_tokens for o in outs[True])
    prompt = sum(len(o.prompt_token_ids) for o in outs[True])
    diff = max(abs(a.outputs[0].logprobs[i][t].logprob - b.outputs[0].logprobs[i][t].logprob)
               for a, b in zip(outs[False], outs[True], strict=True)
               for i, t in enumerate(a.outputs[0].token_ids))
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs[False], outs[True], strict=True))
    print(f"model={args.model or 'embedded tiny V4.1'} device={args.device} dtype={args.dtype} prefix={args.prefix} "
          f"suffix={args.suffix} concurrency={args.concurrency} max_tokens={args.max_tokens} repeats={args.repeats} "
          f"max_num_batched_tokens={args.max_num_batched_tokens or 'engine default'}")
    print(f"cache off: {off * 1e3:.1f} ms   cache on: {on * 1e3:.1f} ms   saved {(1 - on / off) * 100:.1f}% "
          f"({off / on:.2f}x)")
    print(f"prompt tokens {prompt}, served from the cache {cached} ({cached / prompt * 100:.1f}%); "
          f"same tokens: {same}; max |logprob difference| {diff:.3g}")


if __name__ == "__main__":
    main()
