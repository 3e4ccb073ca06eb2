"""The DSpark drafter's data and acceptance, measured with DeepInfer's own model and drafter: target-written
sequences (sampled prompt, greedy continuation) with the drafter's input features captured on the way, and
offline speculative steps against the target's greedy tokens.  Used by ``tools.train.tiny_dspark`` and the
embedded model's test."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kv.pool import PooledState
from deepinfer.models import ForwardBatch
from deepinfer.models.deepseek_v41.dspark import DSparkDrafter
from deepinfer.spec_decode.drafter import DraftRequest


def slot_state(slot: int) -> PooledState:
    """A target state holding pool slot ``slot``: all the DSpark drafter reads of a state, for tests and tools that
    drive the drafter without running the target's steps (no pool behind it)."""
    return PooledState(None, slot)  # type: ignore[arg-type]


@dataclass
class Sequences:
    """Target-written sequences: tokens [N, L], the first greedy position of each [N], features [N, L, F]."""

    tokens: torch.Tensor
    greedy_from: torch.Tensor
    features: torch.Tensor


# --------------------------------------------------------------------------------------------------
# Data: the target writes it.
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def generate(model, n: int, length: int, prompt_min: int, prompt_max: int, seed: int, bos: int) -> Sequences:
    """n sequences of ``length`` tokens: BOS, sampled tokens up to a random prompt length, then greedy; tokens on
    the CPU, features on the model's device."""
    gen, device = torch.Generator().manual_seed(seed), model.device  # the draws on the CPU, on any device
    prompt = torch.randint(prompt_min, prompt_max + 1, (n,), generator=gen)
    tokens = torch.full((n, length), bos, dtype=torch.int64)
    states = [model.new_state() for _ in range(n)]
    features = []
    for p in range(length - 1):
        batch = ForwardBatch(tokens[:, p].to(device), torch.full((n,), p, device=device), [1] * n, states,
                             capture_rows=torch.arange(n, device=device))
        logits = model.compute_logits(model.forward(batch)).cpu()
        features.append(batch.captured)
        sampled = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)[:, 0]
        tokens[:, p + 1] = torch.where(p + 1 < prompt, sampled, logits.argmax(dim=-1))
    for state in states:
        state.release()
    features.append(torch.zeros_like(features[0]))  # the last token's features are never read
    return Sequences(tokens, prompt, torch.stack(features, dim=1))


@torch.no_grad()
def measure(model, data: Sequences, k: int) -> dict[str, object]:
    """Speculative steps with DeepInfer's drafter against the target's greedy tokens of each held-out sequence:
    (mean acceptance length = tokens per target step, per-position conditional acceptance, confidence)."""
    drafter = DSparkDrafter.from_model(model, num_slots=1)
    steps, tokens_out = 0, 0
    tried, taken, conf_sum = torch.zeros(k), torch.zeros(k), torch.zeros(k)
    n, length = data.tokens.shape
    for i in range(n):
        seq, first = data.tokens[i], int(data.greedy_from[i])
        state = slot_state(0)
        drafter.free(state)
        drafter.extend([state] * first, torch.arange(first, device=model.device), data.features[i, :first])
        anchor = first  # the target's first greedy token: the first speculative step's anchor
        while anchor + k < length:
            drafts = drafter.draft([DraftRequest(state, int(seq[anchor]), anchor, 0.0, 0, 0)], k)
            truth = seq[anchor + 1 : anchor + 1 + k]
            match = (drafts.tokens[0].cpu() == truth).int().cumprod(0)
            accepted = int(match.sum())
            live = min(accepted + 1, k)  # positions that were verified
            tried[:live] += 1
            taken[:accepted] += 1
            conf_sum[:live] += drafts.confidence[0, :live].cpu()
            steps, tokens_out = steps + 1, tokens_out + accepted + 1
            new = torch.arange(anchor, anchor + accepted + 1, device=model.device)
            drafter.extend([state] * len(new), new, data.features[i, new])
            anchor += accepted + 1
    return {"sequences": n, "steps": steps, "acceptance_length": tokens_out / max(steps, 1),
            "per_position": (taken / tried.clamp(min=1)).tolist(),
            "mean_confidence": (conf_sum / tried.clamp(min=1)).tolist()}
