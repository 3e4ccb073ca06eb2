"""A step's host-built index tensors reach the device through the backend's copy service (``Backend.to_device``),
so a backend can make them non-blocking (CUDA: pinned staging + ``non_blocking=True``) without core branching on
the device.  Checked on the CPU with a backend that records every copy."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.backends import Backend
from tests.support.v4_fixtures import SMALL, build_engine_checkpoint

PROMPTS = ["Once upon a time", "The quick brown fox", "x"]


class RecordingBackend(Backend):
    """The base class's copies, each one recorded (a copy of the host tensor as it was handed over)."""

    name = "recording"

    def __init__(self) -> None:
        self.copies: list[torch.Tensor] = []

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        assert t.device.type == "cpu", "to_device is for host tensors"
        self.copies.append(t.clone())
        return super().to_device(t, device)


def test_default_to_device_is_a_plain_copy():
    t = torch.arange(5)
    out = Backend().to_device(t, torch.device("cpu"))
    assert torch.equal(out, t) and out.dtype == t.dtype


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory, _ = build_engine_checkpoint(tmp_path_factory.mktemp("tiny_v4_to_device"), SMALL)
    return directory


def _run(llm: LLM, backend: Backend) -> tuple[LLM, list[list[int]]]:
    """``llm``'s model and tokenizer in an engine on ``backend`` (whose runner builds its graphs there), and its
    tokens."""
    llm = LLM.from_model(llm.engine.model, llm.tokenizer, backend=backend,
                         eos_token_ids=llm.engine.config.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    return llm, [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_v4_steps_upload_ids_positions_lengths_and_rows_through_the_backend(checkpoint):
    loaded = LLM(str(checkpoint), dtype="float32")
    _, expected = _run(loaded, Backend())
    recording = RecordingBackend()
    llm, tokens = _run(loaded, recording)
    assert tokens == expected
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    copied = [c.tolist() for c in recording.copies]
    # the prefill step: token ids and positions of the three prompts, the ragged layout's lengths
    assert sum(prompts, []) in copied
    assert sum((list(range(len(p))) for p in prompts), []) in copied
    assert [len(p) for p in prompts] in copied
    # decode steps go through the graph's host staging buffer (Backend.host_buffer), one packed copy per step:
    # token ids, positions, slots, page tables, padded to the 4-row bucket; it holds the last step's inputs
    graphs = llm.engine.runner.decode_graphs
    (graph,) = graphs._graphs.values()
    staged = graph.staging[graph.turn ^ 1].tolist()  # the buffer the last step used
    assert staged[3] == 0 and staged[4 + 3] == 0  # the padding row: token 0 at position 0 ...
    assert staged[8 + 3] == 0 and all(s > 0 for s in staged[8:11])  # ... in the null slot; sequences elsewhere
    # 3 tokens: the prefill samples the first, two decode steps feed tokens at positions len(p) and len(p) + 1
    assert staged[4:7] == [len(p) + 1 for p in prompts]
    # the rows whose logits are computed (each sequence's last row) and the prompt-logprob targets
    ends = [sum(len(p) for p in prompts[: i + 1]) - 1 for i in range(len(prompts))]
    assert ends in copied
    assert sum((p[1:] for p in prompts), []) in copied
    assert all(c.dtype == torch.int64 for c in recording.copies)
