"""The DSpark drafter's sequential heads: the Markov head, the confidence head and the left-to-right draw.

The backbone gives every block position its base logits at once; the Markov head then makes each draft depend
on the one drawn before it (vLLM ``DSparkSpeculator._sample_sequential``, DeepSpec ``apply_block_logits``)::

    code_j  = markov_embed[prev_j]                     # [r]; prev_0 = the anchor, prev_j = draft_{j-1}
    logit_j = base_j + markov_head @ code_j            # [V]
    conf_j  = sigmoid(w . [hidden_j, code_j])          # fp32, hidden_j before the final norm (vLLM's V4.1)
    draft_j ~ softmax(logit_j / T)  (argmax at T = 0)

``conf_j`` estimates P(draft_j accepted | drafts before it accepted): the budget multiplies them into survival.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from deepinfer.ops import Ops


class MarkovHead:
    """Rank-r transition bias: ``markov_head.embed`` [V, r] codes the previous token, ``markov_head.head``
    [V, r] maps the code to a logit bias."""

    def __init__(self, ops: Ops, get: Callable[[str], torch.Tensor], prefix: str):
        self.ops = ops
        self.embed, self.head = get(prefix + "markov_head.embed.weight"), get(prefix + "markov_head.head.weight")

    def __call__(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [B, r], logit biases [B, V] fp32) of the previous tokens ``prev`` [B]."""
        code = self.ops.embedding(prev, self.embed)
        return code, self.ops.linear(code, self.head).float()


class ConfidenceHead:
    """``confidence_head.proj`` [1, D + r], applied in fp32 to ``[hidden, code]``."""

    def __init__(self, ops: Ops, get: Callable[[str], torch.Tensor], prefix: str):
        self.ops, self.weight = ops, get(prefix + "confidence_head.proj.weight").float()

    def __call__(self, hidden: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """[B] fp32 probabilities."""
        features = torch.cat([hidden.float(), code.float()], dim=-1)
        return torch.sigmoid(self.ops.linear(features, self.weight)[:, 0])


def draw(logits: torch.Tensor, temperatures: Sequence[float], generators: Sequence[torch.Generator | None]
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens [B] int64, the distributions they were drawn from [B, V] fp32, or None when every row is greedy)
    from logits [B, V] fp32.

    A row with temperature 0 takes the argmax (its distribution: one-hot); the others sample
    ``softmax(logits / T)`` by an exponential race (``argmax q / E``, E ~ Exp(1)) with the row's generator
    (the global one if None), so a seeded request drafts the same tokens every run."""
    tokens = logits.argmax(dim=-1)
    sampled = [b for b, t in enumerate(temperatures) if t > 0]
    if not sampled:
        return tokens, None
    probs = torch.nn.functional.one_hot(tokens, logits.shape[1]).float()
    for b in sampled:
        q = torch.softmax(logits[b] / temperatures[b], dim=-1)
        gen = generators[b]
        device = gen.device if gen is not None else logits.device
        noise = torch.empty(logits.shape[1], dtype=torch.float32, device=device).exponential_(generator=gen)
        tokens[b] = (q / noise.to(q.device)).argmax()
        probs[b] = q
    return tokens, probs
