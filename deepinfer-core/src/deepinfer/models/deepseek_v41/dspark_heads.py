"""The DSpark drafter's sequential heads: the Markov head, the confidence head and the left-to-right draw.

The backbone gives every block position its base logits at once; the Markov head then makes each draft depend
on the one drawn before it (vLLM ``DSparkSpeculator._sample_sequential``, DeepSpec ``apply_block_logits``)::

    code_j  = markov_embed[prev_j]                     # [r]; prev_0 = the anchor, prev_j = draft_{j-1}
    logit_j = base_j + markov_head @ code_j            # [V]
    conf_j  = sigmoid(w . [hidden_j, code_j])          # fp32, hidden_j before the final norm (vLLM's V4.1)
    draft_j ~ softmax(logit_j / T)  (argmax at T = 0; the race over the noise of (seed, s + j), s the output
                                       position of the first draft: see deepinfer.ops.speculative)

``conf_j`` estimates P(draft_j accepted | drafts before it accepted): the budget multiplies them into survival.
"""

from __future__ import annotations

from collections.abc import Callable

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


def draw(ops: Ops, logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
         ) -> torch.Tensor:
    """Tokens [B] int64 from logits [B, V] fp32, on the device with no host data (a captured draft pass draws
    this way).

    temperatures [B] fp32 (0: greedy); seeds [B] int64 (the requests' seeds as signed 64-bit); steps [B] int64
    (the drafted tokens' output positions).  A row with temperature 0 takes the argmax; the others sample
    ``softmax(logits / T)`` by :func:`~deepinfer.ops.sampling.sample_tokens`' race over the counter-based noise of
    (seed, step): the noise the verifier races the target with at that position, so the draft equals the target's
    token as often as a coupling allows (:mod:`deepinfer.ops.speculative`)."""
    sampled = temperatures > 0
    scaled = logits / torch.where(sampled, temperatures, torch.ones_like(temperatures))[:, None]
    return ops.sample_tokens(scaled, ~sampled, seeds, steps)
