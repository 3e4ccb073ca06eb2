"""Shared pieces of the structured-output tests: a tokenizer and a decoding loop over random logits.

The tokenizer is the tiny V4 model's when it is present (``deepinfer/assets/tiny_v4``); otherwise a
small byte-level BPE is trained here, deterministically, on text that looks like what the tests
generate (byte-level BPE can spell any string, so every grammar stays reachable).
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from deepinfer.ops import OpTable
from deepinfer.structured import GrammarMatcher, allocate_token_bitmask, fill_token_bitmask
from tests.support.tiny_assets import TINY_V4_DIR

EMBEDDED_TOKENIZER = TINY_V4_DIR  # a story tokenizer of ~1,000 words (the V4.1 asset's is the same corpus's)
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"

_CORPUS = [
    '{"name": "Lily", "age": 7, "pets": ["cat", "dog"], "member": true}',
    '{"name":"Tom","age":42,"member":false}',
    "Call (555) 123-4567 or +1 (212) 555-0100 today.",
    "Write to anna@example.com, ben@mail.org or zoe@site.net.",
    "(12,abc,7,xyz) (1+2)-(30+4) yes no maybe",
    "Once upon a time there was a little girl named Mia who liked to play in the park.",
]


@functools.lru_cache(maxsize=1)
def build_tokenizer() -> PreTrainedTokenizerFast:
    """tiny_v4's tokenizer, or a byte-level BPE trained on ``_CORPUS`` (about a second)."""
    if (EMBEDDED_TOKENIZER / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(EMBEDDED_TOKENIZER)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=[BOS, EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def decode_random(
    matchers: list[GrammarMatcher | None],
    vocab_size: int,
    *,
    temperature: float,
    seed: int,
    eos_id: int,
    max_steps: int = 300,
) -> tuple[list[list[int]], list[bool]]:
    """Generate for a batch from seeded random logits: mask → choose (argmax or sample) → accept.

    Returns each row's tokens (without the final stop token) and whether it finished.  A constrained
    row finishes when its matcher terminates; a free row when it draws ``eos_id``.
    """
    gen = torch.Generator().manual_seed(seed)
    ops = OpTable()
    outputs: list[list[int]] = [[] for _ in matchers]
    done = [False] * len(matchers)
    bitmask = allocate_token_bitmask(len(matchers), vocab_size)
    for _ in range(max_steps):
        active = [i for i, d in enumerate(done) if not d]
        if not active:
            break
        fill_token_bitmask([matchers[i] for i in active], bitmask)
        logits = 3.0 * torch.randn(len(active), vocab_size, generator=gen)
        masked = ops.apply_token_bitmask(logits, bitmask[: len(active)])
        if temperature == 0:
            tokens = masked.argmax(-1)
        else:
            tokens = torch.multinomial(torch.softmax(masked / temperature, -1), 1, generator=gen)[:, 0]
        for i, token in zip(active, tokens.tolist(), strict=True):
            matcher = matchers[i]
            if matcher is not None:
                assert matcher.accept(token), f"row {i}: the matcher rejected token {token} its own mask allowed"
                done[i] = matcher.is_terminated()
            else:
                done[i] = token == eos_id
            if token != eos_id:
                outputs[i].append(token)
    return outputs, done
