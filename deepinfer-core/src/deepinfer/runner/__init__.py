"""The model runner: turns a scheduler step into a ``ForwardBatch``, runs the model and the sampler."""

from deepinfer.runner.model_runner import ModelRunner
from deepinfer.step import RunnerOutput, TokenLogprobs

__all__ = ["ModelRunner", "RunnerOutput", "TokenLogprobs"]
