"""DeepSeek-V4.1 (``model_type: deepseek_v41``): the parts built so far (config, Engram); the model is not
registered yet."""

from deepinfer.models.deepseek_v41.config import ConfigError, DeepseekV41Config
from deepinfer.models.deepseek_v41.roles import FULL, REINDEX, REUSE, SWA, LayerRole

__all__ = ["FULL", "REINDEX", "REUSE", "SWA", "ConfigError", "DeepseekV41Config", "LayerRole"]
