"""The model runner: turns a scheduler step into a ``ForwardBatch``, runs the model and the sampler."""

from deepinfer.runner.model_runner import GraphLimits, ModelRunner
from deepinfer.runner.step_plan import StepHandle
from deepinfer.step import RunnerOutput, TokenLogprobs

__all__ = ["GraphLimits", "ModelRunner", "RunnerOutput", "StepHandle", "TokenLogprobs"]
