"""Models: the engine ↔ model contract (:mod:`.base`) and the model implementations."""

from deepinfer.models.base import CausalLM, ForwardBatch, SequenceState
from deepinfer.models.checkpoint_files import CheckpointError
from deepinfer.models.config_fields import ConfigError
from deepinfer.models.loader import load_model, read_model_config
from deepinfer.models.registry import UnsupportedModelError

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ConfigError",
    "ForwardBatch",
    "SequenceState",
    "UnsupportedModelError",
    "load_model",
    "read_model_config",
]
