"""How far decoder prefill truncation (DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact) moves a V4.1 model's output.

For each prompt, greedy generation with the full prefill and with the truncated one (KEEP kept rows): the max
|difference| of the first token's log-probabilities, and how many of the next N greedy tokens agree before the
first difference.  Prompts are random token ids (any model), or with ``--text stories`` the start of fresh
stories of ``tools.train.corpus`` (the embedded model's own domain).  The numbers go into
docs/models/deepseek_v41.md.

    .venv/bin/python -m tools.eval.truncation [--model DIR] [--keep 140 ...] [--tokens 32] [--prompts 16]
                                              [--length 400] [--text random|stories]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics

import torch


def run(model: str | None, keep: int | None, prompts: list[list[int]], tokens: int):
    from deepinfer import LLM, SamplingParams

    if keep is None:
        os.environ.pop("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", None)
    else:
        os.environ["DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"] = "compact"
        os.environ["DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"] = str(keep)
    llm = LLM(model, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=tokens, logprobs=20, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False), llm


def random_prompts(tokenizer, vocab_size: int, count: int, length: int) -> list[list[int]]:
    """Uniform draws from the ids of ordinary text tokens (the specials excluded)."""
    rng = random.Random(0)
    text = tokenizer.decode(list(range(3, vocab_size)), skip_special_tokens=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [[rng.choice(ids) for _ in range(length)] for _ in range(count)]


def story_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, each the start of its own run of fresh stories (bos story eos ...)."""
    from tools.train.corpus import build_corpus, pack

    rows = pack(tokenizer, build_corpus(40 * count * max(1, length // 256), seed=4242), length)
    assert len(rows) >= count, "not enough story text for the prompts"
    return rows[:: len(rows) // count][:count].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--keep", type=int, nargs="+", default=[140], help="one or more KEEP values")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--length", type=int, default=400, help="prompt length in tokens")
    parser.add_argument("--text", choices=["random", "stories"], default="random")
    args = parser.parse_args()
    torch.set_num_threads(1)
    full, llm = run(args.model, None, [[0]], 1)
    if args.text == "stories":
        prompts = story_prompts(llm.tokenizer, args.prompts, args.length)
    else:
        prompts = random_prompts(llm.tokenizer, llm.engine.model.vocab_size, args.prompts, args.length)
    full, _ = run(args.model, None, prompts, args.tokens)
    for keep in args.keep:
        report(full, run(args.model, keep, prompts, args.tokens)[0], args, keep)


def report(full, cut, args: argparse.Namespace, keep: int) -> None:
    gaps, agree = [], []
    for a, b in zip(full, cut, strict=True):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        gaps.append(max(abs(first_a[t].logprob - first_b[t].logprob) for t in first_a if t in first_b))
        same = 0
        for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids, strict=True):
            if x != y:
                break
            same += 1
        agree.append(same)
    print(f"model {args.model or 'embedded'}, {args.text} prompts {args.prompts} x {args.length} tokens, "
          f"KEEP {keep}")
    print(f"first-token logprob |diff| (top-20): median {statistics.median(gaps):.3g}, max {max(gaps):.3g}")
    print(f"greedy tokens equal before the first difference (of {args.tokens}): median "
          f"{statistics.median(agree)}, min {min(agree)}, all equal in {sum(a == args.tokens for a in agree)}")


if __name__ == "__main__":
    main()
