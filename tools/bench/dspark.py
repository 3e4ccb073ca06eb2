"""Decode tokens/s with DSpark speculative decoding against plain decoding, through ``LLM.generate``.

    python -m tools.bench.dspark --model DIR [--batches 1,16,64] [--acceptance 1.5,2.5,3.5] [--real]
                                 [--k 4] [--new-tokens 64] [--prompt-len 256] [--json PATH]
    python -m tools.bench.dspark --slice [--tiny] [--profile] [--host-phases] [...]

Per batch size: plain decoding, then speculative decoding with the checkpoint's drafter (``make_drafter``; a
stand-in proposing arbitrary tokens when the checkpoint has none) at each forced acceptance length L: the runner
accepts L - 1 drafts a step whatever the target says (``set_drafter(forced_acceptance=)``, benchmark only, lossy),
so a slice with random weights measures the engine at a given acceptance.  ``--real`` adds a run that verifies for
real (meaningful with trained weights; its measured acceptance length is reported).  Greedy requests with
``ignore_eos``; decode time = one run's span from the first request's first token to the last request's last
token, best of ``--repeats``.

``--slice``: no checkpoint; the V4.1-Flash slice of ``tools.bench.v41_slice`` (8 layers at V4.1-Flash's dims,
bf16 random weights) on the GPU with a DSpark drafter of random weights at the same dims (``tools.bench.
v41_slice_engine``); ``--slice --tiny``: both at toy dims on the CPU (tests the script).  The output says which
drafter ran, and how many steps of each mode replayed captured graphs: plain decoding's decode steps, speculative
decoding's verify steps (draft, then one fixed-shape forward of anchor and drafts: ``runner/verify_graphs.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch


class ArbitraryDrafter:
    """Proposes ``anchor + 1, anchor + 2, ...`` (mod the vocabulary): only its cost and shape matter when the
    acceptance is forced."""

    capture_layer_ids: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, max_draft_len: int, device: torch.device):
        self.vocab_size, self.max_draft_len, self.device = vocab_size, max_draft_len, device

    def extend(self, states, positions, features) -> None:
        pass

    def draft(self, requests, k):
        from deepinfer.spec_decode.drafter import Drafts

        anchors = torch.tensor([r.anchor for r in requests], dtype=torch.int64)
        tokens = (anchors[:, None] + torch.arange(1, k + 1)[None, :]) % self.vocab_size
        return Drafts(tokens.to(self.device), torch.full((len(requests), k), 0.5, device=self.device))

    def truncate(self, state, length: int) -> None:
        pass

    def fork(self, src, dst) -> None:
        pass

    def free(self, state) -> None:
        pass


def spec_policy(engine, drafter, k: int):
    """The engine's own policy for ``k`` drafts: every draft verified, or with ``DEEPINFER_ENABLE_MTP_VARLEN=1``
    confidence-scheduled verification with the step costs measured now (as :meth:`Engine.set_drafter` builds it
    from the environment)."""
    import dataclasses

    from deepinfer import envs
    from deepinfer.engine.speculation import policy_from_env

    env = dataclasses.replace(envs.spec_decode(), draft_len=min(k, drafter.max_draft_len), draft_len_set=True)
    return policy_from_env(drafter, engine.model, engine.runner.backend, engine.config, env)


def _decode_time(llm, prompts, new_tokens: int, repeats: int) -> tuple[float, list]:
    """Best of ``repeats`` decode windows (after a warm-up run) and the last run's outputs.  A window is one run's
    span from the first request's first token to the last request's last token (the engine's request metrics), in
    which the batch makes its ``new_tokens - 1`` tokens a request.  (This replaced the wall time of a
    ``new_tokens`` run minus that of a 1-token run: two separate, noisy measurements of mostly prefill, whose
    difference -- the best of them taken -- could come out several times too small on a host-bound model.)"""
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (graphs, caches)
    best, outs = float("inf"), []
    for _ in range(repeats):
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, decode_window(outs))
    return best, outs


def decode_window(outs) -> float:
    """Seconds from the first first-token to the last last-token of ``outs`` (``RequestOutput.metrics``)."""
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    return max(last - first, 1e-9)


class StepCounter:
    """Counts the runner's steps, and those replayed from captured decode or verify graphs (wraps the methods;
    the verify graphs once the engine has made them, at the first speculative step)."""

    def __init__(self, runner) -> None:
        self.steps = self.graph_steps = 0
        launch = runner.launch

        def counted_launch(*args, **kwargs):
            self.steps += 1
            if runner.verify_graphs is not None and not hasattr(runner.verify_graphs.run, "counted"):
                self._count(runner.verify_graphs)
            return launch(*args, **kwargs)

        runner.launch = counted_launch
        if runner.decode_graphs is not None:
            self._count(runner.decode_graphs)

    def _count(self, graphs) -> None:
        run = graphs.run

        def counted_run(*args, **kwargs):
            self.graph_steps += 1
            return run(*args, **kwargs)

        counted_run.counted = True
        graphs.run = counted_run

    def take(self) -> tuple[int, int]:
        """(steps, of which graph replays) since the last call."""
        counts = self.steps, self.graph_steps
        self.steps = self.graph_steps = 0
        return counts


def load_checkpoint(model: str, dtype: str, max_seqs: int, k: int):
    """(LLM, drafter, the drafter in words): the checkpoint's drafter, else :class:`ArbitraryDrafter`."""
    from deepinfer import LLM, envs

    # Where decode steps replay captured graphs (CUDA) the engine leaves drafting off by default and does not read
    # the drafter's weights (engine/llm.py ``drafter_off``): ask for it, as a user would, to build it.
    asked = contextlib.nullcontext() if "DEEPINFER_USE_NEXTN_DECODE" in os.environ else envs.overridden(
        "DEEPINFER_USE_NEXTN_DECODE", str(k))
    with asked:
        llm = LLM(model, dtype=dtype, max_num_seqs=max_seqs)
    engine = llm.engine
    drafter = engine.drafter
    if drafter is None:
        make = getattr(engine.model, "make_drafter", None)
        drafter = make() if make is not None else None
    if drafter is None:
        print("the checkpoint has no drafter: a stand-in proposes arbitrary tokens", file=sys.stderr)
        return llm, ArbitraryDrafter(engine.model.vocab_size, k, engine.model.device), "ArbitraryDrafter stand-in"
    return llm, drafter, f"the checkpoint's ({type(drafter).__name__})"


def load_slice(tiny: bool, max_seqs: int, tokens: int):
    """(LLM, drafter, the drafter in words) over the V4.1-Flash slice with a random DSpark drafter; the state
    cache holds ``max_seqs`` sequences of ``tokens`` tokens."""
    from tools.bench.v41_slice_engine import build_slice, describe, describe_drafter, slice_drafter, slice_llm

    began = time.perf_counter()
    model = build_slice(tiny, drafter=True)
    # no prefix cache: the repeats re-send the same prompts, and each run must compute its prefill as run(1) did
    llm = slice_llm(model, max_num_seqs=max_seqs, state_cache_bytes=model.state_pool_bytes(max_seqs, tokens),
                    enable_prefix_caching=False)
    drafter = slice_drafter(model, tiny)
    print(f"built {describe(model)} in {time.perf_counter() - began:.1f} s", flush=True)
    return llm, drafter, describe_drafter(drafter)


def bench(llm, drafter, policy, counter: StepCounter, batches: list[int], acceptance: list[float], new_tokens: int,
          prompt_len: int, real: bool, repeats: int) -> list[dict[str, object]]:
    engine = llm.engine
    engine.set_drafter(None)
    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(3, engine.model.vocab_size, (prompt_len,), generator=gen).tolist()
                   for _ in range(batch)]
        counter.take()
        plain, _ = _decode_time(llm, prompts, new_tokens, repeats)
        base = batch * (new_tokens - 1) / plain
        steps, graphs = counter.take()
        rows.append(dict(batch=batch, mode="plain", acceptance=1.0, verified=0.0, tokens_per_s=base, speedup=1.0,
                         steps=steps, graph_steps=graphs))
        for length in acceptance + ([0.0] if real else []):
            engine.set_drafter(drafter, policy, forced_acceptance=length or None)
            try:
                took, outs = _decode_time(llm, prompts, new_tokens, repeats)
            finally:
                engine.set_drafter(None)
            stats = [o.spec_decoding_stats for o in outs if o.spec_decoding_stats is not None]
            verify_steps = max(1, sum(s.num_drafts for s in stats))
            measured = sum(s.num_accepted_tokens for s in stats) / verify_steps + 1.0
            verified = sum(s.num_draft_tokens for s in stats) / verify_steps
            speed = batch * (new_tokens - 1) / took
            steps, graphs = counter.take()
            rows.append(dict(batch=batch, mode="forced" if length else "real", acceptance=round(measured, 3),
                             verified=round(verified, 2), tokens_per_s=speed, speedup=speed / base, steps=steps,
                             graph_steps=graphs))
    return rows


def step_profile(llm, drafter, counter: StepCounter, batch: int, length: float, k: int, new_tokens: int,
                 prompt_len: int) -> str:
    """Kernels of one decode step, plain and speculative at forced acceptance ``length``: the kernel totals of a
    ``new_tokens`` run minus those of a 1-token run (the prefill), over the steps between them; with the host's
    wall time a step (what the kernels leave to launches, read-backs and host work)."""
    from deepinfer import SamplingParams
    from tools.bench.steps import kernel_totals, profile_table

    engine = llm.engine
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, engine.model.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    out = []
    for mode in ("plain", "speculative"):
        if mode == "speculative":
            engine.set_drafter(drafter, spec_policy(engine, drafter, k), forced_acceptance=length)
        try:
            runs = {}
            for n in (new_tokens, 1, new_tokens):  # the first: warm-up
                params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                counter.take()
                began = time.perf_counter()
                totals = kernel_totals(lambda params=params: llm.generate(prompts, params, use_tqdm=False), 1)
                runs[n] = (totals, time.perf_counter() - began, counter.take()[0])
        finally:
            engine.set_drafter(None)
        (full, wall, steps), (first, wall1, steps1) = runs[new_tokens], runs[1]
        diff = {name: [v[0] - first.get(name, [0.0, 0])[0], v[1] - first.get(name, [0.0, 0])[1]]
                for name, v in full.items()}
        n = max(1, steps - steps1)
        label = f"L = {length}" if mode == "speculative" else "plain"
        out.append(f"{mode} decode step, batch {batch}, {label}: {n} steps, {(wall - wall1) / n * 1e3:.2f} ms wall "
                   "a step (profiled)\n" + profile_table({k_: v for k_, v in diff.items() if v[0] > 0}, n))
    return "\n\n".join(out)


class PhaseTimer:
    """Host wall time per phase of the engine's steps: wraps ``(owner, attribute)`` callables (inclusive times: a
    phase includes the phases it calls).  ``Tensor.tolist`` is the read-back wait."""

    def __init__(self, phases: dict[str, tuple[object, str]]) -> None:
        self.totals = {name: 0.0 for name in phases}
        self.calls = {name: 0 for name in phases}
        self._undo: list[tuple[object, str, object | None]] = []
        for name, (owner, attr) in phases.items():
            self._wrap(name, owner, attr)

    def _wrap(self, name: str, owner: object, attr: str) -> None:
        inner = getattr(owner, attr)
        self._undo.append((owner, attr, vars(owner).get(attr)))  # None: it came from the class (or a base)

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - began
                self.calls[name] += 1

        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


def host_phases(llm, drafter, batch: int, length: float, k: int, new_tokens: int, prompt_len: int) -> str:
    """Host wall time a step by phase in a speculative run at forced acceptance ``length`` (0: real acceptance;
    one ``new_tokens`` run after a warm-up): what the host does between read-backs, which the device waits on."""
    from deepinfer import SamplingParams
    from deepinfer.runner import speculative

    engine = llm.engine
    runner = engine.runner
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, engine.model.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.set_drafter(drafter, spec_policy(engine, drafter, k), forced_acceptance=length or None)
    try:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: graphs
        phases: dict[str, tuple[object, str]] = {
            "engine.step": (engine, "step"), "  schedule": (engine, "schedule"),
            "  process (outputs)": (engine, "process"), "  runner.launch": (runner, "launch"),
            "    draft": (speculative, "_draft"), "    verify graph run": (runner.verify_graphs, "run"),
            "      verify_inputs": (engine.model, "verify_inputs"),
            "    verify (+ read-back)": (speculative, "_verify"),
            "      read-back wait (tolist)": (torch.Tensor, "tolist"),
            "    commit_verify": (engine.model, "commit_verify"), "    extend drafter": (speculative, "_extend"),
        }
        timer = PhaseTimer(phases)
        began = time.perf_counter()
        try:
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            timer.restore()
        wall = time.perf_counter() - began
    finally:
        engine.set_drafter(None)
    steps = max(1, timer.calls["engine.step"])
    how = f"L = {length}" if length else "real acceptance"
    lines = [f"host phases, speculative, batch {batch}, {how}, {new_tokens} new tokens: {steps} engine steps, "
             f"{wall / steps * 1e3:.2f} ms wall a step (inclusive times, ms a step)"]
    lines += [f"{name:<32} {timer.totals[name] / steps * 1e3:8.3f}  ({timer.calls[name]} calls)" for name in phases]
    return "\n".join(lines)


def graphs_line(llm, rows: list[dict[str, object]]) -> str:
    """Whether plain decoding replayed captured graphs and speculative steps ran eagerly, from the counts."""
    from deepinfer.backends import Backend

    engine = llm.engine
    backend = engine.runner.backend
    captures = type(backend).graph_capture is not Backend.graph_capture
    graphs = engine.runner.decode_graphs
    if graphs is None:
        return "decode graphs: off (enforce_eager, or the model has no fixed-shape decode step): every step eager"

    def total(mode: str, key: str) -> int:
        return sum(int(r[key]) for r in rows if (r["mode"] == "plain") == (mode == "plain"))  # type: ignore[call-overload]

    how = "captured (CUDA graphs)" if captures else "re-executed (this backend does not capture)"
    line = (f"decode graphs {how} on backend {type(backend).__name__}: plain decoding replayed "
            f"{total('plain', 'graph_steps')} of its {total('plain', 'steps')} steps (the rest: prefills); "
            f"speculative decoding {total('spec', 'graph_steps')} of {total('spec', 'steps')} as captured verify "
            "steps (the rest: prefills, eagerly)")
    if graphs.eager_reason:
        line += f"; a capture failed, decode steps ran eagerly: {graphs.eager_reason}"
    verify = engine.runner.verify_graphs
    if verify is not None and verify.eager_reason:
        line += f"; a verify capture failed, verify steps ran eagerly: {verify.eager_reason}"
    drafts = engine.runner.draft_graphs
    if drafts is None:
        line += "; draft passes eager (the drafter is not a GraphDrafter)"
    else:
        line += f"; draft passes {how} per (bucket, k, sampled): {sorted(drafts._graphs)}"
        if drafts.eager_reason:
            line += f" (a capture failed, they ran eagerly: {drafts.eager_reason})"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory (or repo id)")
    parser.add_argument("--slice", action="store_true",
                        help="no checkpoint: the V4.1-Flash slice (GPU, bf16) with a random DSpark drafter")
    parser.add_argument("--tiny", action="store_true", help="with --slice: toy dims on the CPU")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--acceptance", default="1.5,2.5,3.5", help="forced acceptance lengths (tokens per step)")
    parser.add_argument("--real", action="store_true", help="also verify for real")
    parser.add_argument("--k", type=int, default=4, help="drafts per step (capped by the drafter)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="with --model (the slice is bf16)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--profile", action="store_true",
                        help="also print the kernels of a plain and a speculative decode step (first batch, last L)")
    parser.add_argument("--host-phases", action="store_true",
                        help="also print the host's time a step by phase in a speculative run (first batch, last L; "
                             "with --real: real acceptance)")
    args = parser.parse_args(argv)
    acceptance = [float(x) for x in args.acceptance.split(",") if x]
    if any(not 1.0 <= a <= args.k + 1 for a in acceptance):
        parser.error(f"--acceptance values must be in [1, k + 1 = {args.k + 1}]")
    if (args.model is None) == (not args.slice):
        parser.error("give --model DIR or --slice")
    if args.tiny and not args.slice:
        parser.error("--tiny goes with --slice")
    batches = [int(b) for b in args.batches.split(",")]
    if args.slice:
        llm, drafter, drafter_name = load_slice(args.tiny, max(batches), args.prompt_len + args.new_tokens + args.k + 1)
    else:
        llm, drafter, drafter_name = load_checkpoint(args.model, args.dtype, max(batches), args.k)
    print(f"drafter: {drafter_name}", flush=True)
    counter = StepCounter(llm.engine.runner)  # (it wraps the runner's methods: one a run)
    policy = spec_policy(llm.engine, drafter, args.k)
    rows = bench(llm, drafter, policy, counter, batches, acceptance, args.new_tokens, args.prompt_len, args.real,
                 args.repeats)
    print(f"policy: up to {policy.max_draft_len} drafts a step, " + (
        "confidence-scheduled verification (DEEPINFER_ENABLE_MTP_VARLEN=1)" if policy.varlen
        else "every draft verified (DEEPINFER_ENABLE_MTP_VARLEN=0)"))
    print(f"{'batch':>5} {'mode':>7} {'accept':>7} {'verified':>8} {'tokens/s':>10} {'speedup':>8} "
          f"{'graph steps':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['mode']:>7} {r['acceptance']:>7.2f} {r['verified']:>8.2f} "
              f"{r['tokens_per_s']:>10.1f} {r['speedup']:>8.2f} {r['graph_steps']:>5} of {r['steps']:<4}")
    print(graphs_line(llm, rows))
    if args.slice:
        from tools.bench.v41_slice_engine import check_shared_stack, jit_line

        print(check_shared_stack(llm.engine.model))
        if jit_line(llm.engine.model):
            print(jit_line(llm.engine.model))
    if args.profile:
        print(step_profile(llm, drafter, counter, batches[0], acceptance[-1], args.k, args.new_tokens,
                           args.prompt_len))
    if args.host_phases:
        length = 0.0 if args.real else acceptance[-1]
        print(host_phases(llm, drafter, batches[0], length, args.k, args.new_tokens, args.prompt_len))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
