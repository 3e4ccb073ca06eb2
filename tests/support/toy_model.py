"""A test double for ``deepinfer.models.base.CausalLM``: tiny, exact under chunking, with growing state.

One attention layer over every earlier token (keys and values kept in the sequence's state) plus a
tanh MLP, fp32 on the CPU.  Feeding a sequence whole, in chunks or token by token gives the same
hidden states up to float rounding, which is all the engine may assume of a real model.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from deepinfer.models.base import ForwardBatch, StateCapacity


class ToyState:
    """Keys and values of every consumed token."""

    __slots__ = ("keys", "values")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys = keys
        self.values = values

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[0]

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def fork(self) -> ToyState:
        return ToyState(self.keys.clone(), self.values.clone())

    def release(self) -> None:
        self.keys = self.values = torch.empty(0, self.keys.shape[1])


class ToyCausalLM:
    """Honours the ``CausalLM`` contract exactly; ``forward_calls`` records the rows of each call."""

    def __init__(self, vocab_size: int, hidden: int = 32, seed: int = 0, max_position_embeddings: int = 4096,
                 logit_scale: float = 4.0):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.hidden = hidden
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.config = SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings)
        scale = 1 / math.sqrt(hidden)
        self.embed = torch.randn(vocab_size, hidden, generator=g)
        self.wq, self.wk, self.wv, self.wo, self.w1, self.w2 = (
            torch.randn(hidden, hidden, generator=g) * scale for _ in range(6)
        )
        self.head = torch.randn(vocab_size, hidden, generator=g) * (logit_scale * scale)
        freqs = torch.exp(-math.log(1000.0) * torch.arange(0, hidden, 2) / hidden)
        self._freqs = freqs
        self.forward_calls: list[list[int]] = []

    def _positions(self, pos: torch.Tensor) -> torch.Tensor:
        angles = pos.float()[:, None] * self._freqs[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)

    def new_state(self) -> ToyState:
        empty = torch.empty(0, self.hidden)
        return ToyState(empty, empty.clone())

    def state_bytes(self, num_tokens: int) -> int:
        return 2 * num_tokens * self.hidden * 4

    def configure_state(self, max_seqs: int, capacity_bytes: int) -> StateCapacity:
        return StateCapacity(capacity_bytes, max_seqs)  # states are plain tensors allocated as they grow

    def state_pool_bytes(self, max_seqs: int, num_tokens: int, sequences: int | None = None) -> int:
        return (max_seqs if sequences is None else sequences) * self.state_bytes(num_tokens)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        assert sum(batch.seq_lens) == batch.input_ids.numel() == batch.positions.numel()
        assert len(batch.states) == len(batch.seq_lens)
        self.forward_calls.append(list(batch.seq_lens))
        outs, offset = [], 0
        for n, state in zip(batch.seq_lens, batch.states, strict=True):
            ids = batch.input_ids[offset : offset + n]
            pos = batch.positions[offset : offset + n]
            offset += n
            past = state.num_tokens
            expected = torch.arange(past, past + n)
            assert torch.equal(pos, expected), f"positions {pos.tolist()} do not continue the state at {past}"
            assert int(ids.min()) >= 0 and int(ids.max()) < self.vocab_size
            x = self.embed[ids] + self._positions(pos)
            keys = torch.cat([state.keys, x @ self.wk])
            values = torch.cat([state.values, x @ self.wv])
            scores = (x @ self.wq) @ keys.T / math.sqrt(self.hidden)
            causal = torch.arange(past + n)[None, :] > pos[:, None]
            attn = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ values
            h = x + attn @ self.wo
            outs.append(h + torch.tanh(h @ self.w1) @ self.w2)
            state.keys, state.values = keys, values
        return torch.cat(outs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head.T).float()

    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits ``[len, V]`` of a whole sequence in one call (an oracle for the engine)."""
        state = self.new_state()
        ids = torch.tensor(token_ids)
        batch = ForwardBatch(ids, torch.arange(len(token_ids)), [len(token_ids)], [state])
        calls = list(self.forward_calls)
        out = self.compute_logits(self.forward(batch))
        self.forward_calls = calls
        return out


_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a little girl who lived in a small house near the woods.",
    "She liked to read books, sing songs and play in the park with her friends.",
    "Le café est très bon, déjà vu, naïve façade, crème brûlée.",
    "日本語のテキストも少しあります。東京は大きい都市です。",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: + - * / = < > ( ) [ ] { }.",
    "def generate(prompt): return model(prompt) if prompt else None",
]


def toy_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer (BOS prepended) trained on a few lines; deterministic, ~0.1 s."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<bos>", "<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
