"""The plain step types: one module (``deepinfer.step``) that the engine and the runner both import.

The runner imports no engine module (no engine <-> runner cycle), every step type is a slotted dataclass, and a
runner runs a step built by hand from those types alone, with no request, sequence or scheduler.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import torch

import deepinfer.step as step_types
from deepinfer.ops import OpTable
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.sample.sampler import Sampler
from deepinfer.sampling_params import SamplingParams
from deepinfer.step import PromptScoring, SamplingRow, ScheduledChunk, ScheduledSample, StepInput
from tests.support.toy_model import ToyCausalLM


def test_runner_imports_no_engine_module():
    code = (
        "import sys\n"
        "import deepinfer.runner, deepinfer.runner.model_runner, deepinfer.runner.decode_graphs, deepinfer.step\n"
        "print(sorted(m for m in sys.modules if m.startswith('deepinfer.engine')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_step_types_are_slotted_dataclasses():
    classes = [v for v in vars(step_types).values() if isinstance(v, type) and v.__module__ == step_types.__name__]
    assert len(classes) >= 8
    for cls in classes:
        assert dataclasses.is_dataclass(cls) and "__slots__" in vars(cls), cls.__name__


def test_runner_runs_a_step_built_from_plain_types():
    """Two prompts, one sampled greedily with prompt logprobs; the token is the argmax of a whole forward."""
    model = ToyCausalLM(50, seed=3)
    ops = OpTable()
    runner = ModelRunner(model, Sampler(ops), ops)
    a, b = [5, 9, 11, 7], [4, 4, 8]
    greedy = SamplingParams(temperature=0, logprobs=2, prompt_logprobs=1)
    step = StepInput(
        chunks=[ScheduledChunk(0, 0, a, sample=True), ScheduledChunk(1, 0, b, sample=False)],
        states=[model.new_state(), model.new_state()],
        samples=[ScheduledSample(0, SamplingRow(greedy, seed=0, step=0, prompt_ids=a, output_ids=[]))],
        prompt_scoring=[PromptScoring(0, 0, a[1:], 1), None],
    )
    result = runner.launch(step).collect()
    logits = model.full_logits(a)
    assert [seq_id for seq_id, _ in result.sampled] == [0]
    assert result.sampled[0][1].token_id == int(logits[-1].argmax())
    logp = torch.log_softmax(logits, dim=-1)
    assert [(s, p) for s, p, _ in result.prompt_logprobs] == [(0, 1), (0, 2), (0, 3)]
    for (_, position, tl), token in zip(result.prompt_logprobs, a[1:], strict=True):
        assert tl.token_id == token and abs(tl.logprob - logp[position - 1, token].item()) < 1e-5
    assert [s.num_tokens for s in step.states] == [len(a), len(b)]
