"""The public surface: cheap lazy imports, vLLM-shaped outputs, an engine that survives a failing step."""

from __future__ import annotations

import subprocess
import sys

import pytest

import deepinfer
from deepinfer import LLM, CompletionOutput, RequestOutput, SamplingParams
from tests.support.toy_model import ToyCausalLM, toy_tokenizer


def test_import_is_cheap_and_selects_no_backend():
    code = (
        "import sys, deepinfer\n"
        "from deepinfer import SamplingParams\n"
        "SamplingParams(temperature=0.5)\n"
        "heavy = [m for m in ('torch', 'transformers', 'deepinfer.backends.registry', 'deepinfer.engine.llm')"
        " if m in sys.modules]\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_exports():
    assert set(deepinfer.__all__) >= {"LLM", "SamplingParams", "RequestOutput", "CompletionOutput"}
    with pytest.raises(AttributeError):
        deepinfer.NoSuchThing  # noqa: B018


class _FailingModel(ToyCausalLM):
    """Raises on one chosen forward call."""

    fail_at: int | None = None

    def forward(self, batch):
        if self.fail_at is not None and len(self.forward_calls) == self.fail_at:
            self.fail_at = None
            raise RuntimeError("device fell over")
        return super().forward(batch)


def test_outputs_in_input_order_and_engine_survives_a_failing_step():
    tok = toy_tokenizer()
    model = _FailingModel(len(tok), seed=2)
    llm = LLM.from_model(model, tok)
    prompts = ["a", "The quick brown fox jumps", "Le café"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ref = llm.generate(prompts, params, use_tqdm=True)
    assert [o.prompt for o in ref] == prompts and all(isinstance(o, RequestOutput) for o in ref)
    assert all(isinstance(c, CompletionOutput) and c.finish_reason == "length" for o in ref for c in o.outputs)
    assert len({o.request_id for o in ref}) == 3

    model.fail_at = len(model.forward_calls) + 2
    with pytest.raises(RuntimeError, match="device fell over"):
        llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished() and len(engine.state_cache) == 0 and engine.state_cache.budget.used == 0
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]


def test_from_model_uses_the_backend_of_the_models_device():
    from deepinfer.backends import Backend, current_backend

    tokenizer = toy_tokenizer()
    model = ToyCausalLM(len(tokenizer), seed=1)
    backend = LLM.from_model(model, tokenizer).engine.runner.backend  # the toy model lives on the CPU
    selected = current_backend()
    if selected.device_type == "cpu":
        assert backend.name == selected.name
    else:  # a GPU host: the selected backend drives another device, so the base class serves this model
        assert type(backend) is Backend
    mine = Backend()
    assert LLM.from_model(model, tokenizer, backend=mine).engine.runner.backend is mine
