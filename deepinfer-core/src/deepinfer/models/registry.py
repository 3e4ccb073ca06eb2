"""``model_type`` (from config.json) → how to read that model's config and build it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer.models.checkpoint_files import read_json_object
from deepinfer.models.config_fields import Fields


class UnsupportedModelError(ValueError):
    """config.json names a model type this version of DeepInfer cannot run."""


@dataclass(slots=True, frozen=True)
class ModelEntry:
    read_config: Callable[[str | Path], Any]
    load: Callable[..., Any]
    #: ``load`` takes ``engram_placement`` and ``backend`` (a model with Engram tables: V4.1).
    engram: bool = False


def _deepseek_v4() -> ModelEntry:
    from deepinfer.models import deepseek_v4

    return ModelEntry(deepseek_v4.DeepseekV4Config.from_file, deepseek_v4.load)


def _deepseek_v41() -> ModelEntry:
    from deepinfer.models import deepseek_v41

    return ModelEntry(deepseek_v41.DeepseekV41Config.from_file, deepseek_v41.load, engram=True)


#: Entries are resolved lazily so importing the registry builds nothing.  ``deepseek_v41_text`` is the flat
#: config transformers' causal LM writes.
MODELS: dict[str, Callable[[], ModelEntry]] = {"deepseek_v4": _deepseek_v4, "deepseek_v41": _deepseek_v41,
                                               "deepseek_v41_text": _deepseek_v41}
NOT_YET: dict[str, str] = {}


def model_type_of(path: str | Path) -> str:
    path = Path(path)
    config = path / "config.json" if path.is_dir() else path
    if not (config.exists() or config.is_symlink()):
        raise FileNotFoundError(f"no config.json at {path}")
    fields = Fields.of(read_json_object(config), str(config))
    if not fields.has("model_type"):
        raise UnsupportedModelError(f"{config} has no model_type")
    return fields.string("model_type")


def entry_for(path: str | Path) -> ModelEntry:
    model_type = model_type_of(path)
    if model_type in NOT_YET:
        raise UnsupportedModelError(NOT_YET[model_type])
    if model_type not in MODELS:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported: {sorted(MODELS)}")
    return MODELS[model_type]()
