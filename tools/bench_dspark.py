#!/usr/bin/env python
"""Decode tokens/s with DSpark speculative decoding against plain decoding, through ``LLM.generate``.

    python tools/bench_dspark.py --model DIR [--batches 1,16,64] [--acceptance 1.5,2.5,3.5] [--real]
                                 [--k 4] [--new-tokens 64] [--prompt-len 256] [--json PATH]

Per batch size: plain decoding, then speculative decoding with the checkpoint's drafter (``make_drafter``; a
stand-in proposing arbitrary tokens when the checkpoint has none) at each forced acceptance length L: the runner
accepts L - 1 drafts a step whatever the target says (``ModelRunner.forced_acceptance``, benchmark only, lossy),
so a slice with random weights measures the engine at a given acceptance.  ``--real`` adds a run that verifies for
real (meaningful with trained weights; its measured acceptance length is reported).  Greedy requests with
``ignore_eos``; decode time = time of ``--new-tokens`` tokens minus the time of 1 (the prefill), best of
``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


class ArbitraryDrafter:
    """Proposes ``anchor + 1, anchor + 2, ...`` (mod the vocabulary): only its cost and shape matter when the
    acceptance is forced."""

    capture_layer_ids: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, max_draft_len: int, device: torch.device):
        self.vocab_size, self.max_draft_len, self.device = vocab_size, max_draft_len, device

    def extend(self, slots, positions, features) -> None:
        pass

    def draft(self, requests, k):
        from deepinfer.spec.drafter import Drafts

        anchors = torch.tensor([r.anchor for r in requests], dtype=torch.int64)
        tokens = (anchors[:, None] + torch.arange(1, k + 1)[None, :]) % self.vocab_size
        return Drafts(tokens.to(self.device), None, torch.full((len(requests), k), 0.5, device=self.device))

    def truncate(self, slot: int, length: int) -> None:
        pass

    def fork(self, src: int, dst: int) -> None:
        pass

    def free(self, slot: int) -> None:
        pass


def _decode_time(llm, prompts, new_tokens: int, repeats: int) -> tuple[float, list]:
    from deepinfer import SamplingParams

    def run(n: int):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        began = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - began, outs

    run(new_tokens)  # warm-up (graphs, caches)
    best, outs = float("inf"), []
    for _ in range(repeats):
        prefill, _ = run(1)
        full, outs = run(new_tokens)
        best = min(best, max(full - prefill, 1e-9))
    return best, outs


def bench(model: str, batches: list[int], acceptance: list[float], k: int, new_tokens: int, prompt_len: int,
          real: bool, repeats: int, dtype: str) -> list[dict[str, object]]:
    from deepinfer import LLM
    from deepinfer.spec.budget import SpecPolicy

    llm = LLM(model, dtype=dtype, max_num_seqs=max(batches))
    engine = llm.engine
    drafter = engine.drafter
    if drafter is None:
        make = getattr(engine.model, "make_drafter", None)
        drafter = make() if make is not None else None
    if drafter is None:
        print("the checkpoint has no drafter: a stand-in proposes arbitrary tokens", file=sys.stderr)
        drafter = ArbitraryDrafter(engine.model.vocab_size, k, engine.model.device)
    k = min(k, drafter.max_draft_len)
    engine.set_drafter(None)
    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(3, engine.model.vocab_size, (prompt_len,), generator=gen).tolist()
                   for _ in range(batch)]
        plain, _ = _decode_time(llm, prompts, new_tokens, repeats)
        base = batch * (new_tokens - 1) / plain
        rows.append(dict(batch=batch, mode="plain", acceptance=1.0, tokens_per_s=base, speedup=1.0))
        for length in acceptance + ([0.0] if real else []):
            engine.set_drafter(drafter, SpecPolicy(k))
            engine.runner.forced_acceptance = length or None
            try:
                took, outs = _decode_time(llm, prompts, new_tokens, repeats)
            finally:
                engine.runner.forced_acceptance = None
                engine.set_drafter(None)
            stats = [o.spec_decoding_stats for o in outs if o.spec_decoding_stats is not None]
            measured = (sum(s.num_accepted_tokens for s in stats) / max(1, sum(s.num_drafts for s in stats)) + 1.0)
            speed = batch * (new_tokens - 1) / took
            rows.append(dict(batch=batch, mode="forced" if length else "real", acceptance=round(measured, 3),
                             tokens_per_s=speed, speedup=speed / base))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (or repo id)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--acceptance", default="1.5,2.5,3.5", help="forced acceptance lengths (tokens per step)")
    parser.add_argument("--real", action="store_true", help="also verify for real")
    parser.add_argument("--k", type=int, default=4, help="drafts per step (capped by the drafter)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    acceptance = [float(x) for x in args.acceptance.split(",") if x]
    if any(not 1.0 <= a <= args.k + 1 for a in acceptance):
        parser.error(f"--acceptance values must be in [1, k + 1 = {args.k + 1}]")
    rows = bench(args.model, [int(b) for b in args.batches.split(",")], acceptance, args.k, args.new_tokens,
                 args.prompt_len, args.real, args.repeats, args.dtype)
    print(f"{'batch':>5} {'mode':>7} {'accept':>7} {'tokens/s':>10} {'speedup':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['mode']:>7} {r['acceptance']:>7.2f} {r['tokens_per_s']:>10.1f} {r['speedup']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
