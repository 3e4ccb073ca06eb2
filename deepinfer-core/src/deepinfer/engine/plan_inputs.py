"""What a memory plan is made from: the model's config.json and its tensors' names, shapes and dtypes, read from
the safetensors headers (never the tensor data).

Where the headers come from: a local checkpoint directory's shards; for a Hugging Face repo id, the HF cache's
snapshot, else the hub's own header reads (``huggingface_hub.get_safetensors_metadata``: a few kB per shard,
and the JSON files); with neither (a directory holding only config.json, or offline), the release's layout for
that config (:mod:`deepinfer.models.deepseek_v41.released_layout`), and the plan says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from deepinfer.models.checkpoint import INDEX_FILE, SafetensorsCheckpoint
from deepinfer.models.deepseek_v41.config import MODEL_TYPES, DeepseekV41Config
from deepinfer.models.deepseek_v41.released_layout import StoredTensor, released_layout
from deepinfer.models.registry import model_type_of
from deepinfer.models.weight_reader import canonical_name

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class PlanInputs:
    config: DeepseekV41Config
    tensors: tuple[StoredTensor, ...]
    #: Where the tensors' shapes and dtypes came from, for the plan's header line.
    source: str
    #: The directory holding config.json (a local checkpoint, or the snapshot of a hub repo's JSON files).
    path: Path


def has_shards(path: Path) -> bool:
    return (path / INDEX_FILE).is_file() or any(path.glob("*.safetensors"))


def read_plan_inputs(path: str | Path) -> PlanInputs:
    """The plan's inputs from a checkpoint directory: config.json and, if it has shards, their headers (else the
    released layout).  Raises ``ValueError`` for a model the plan does not cover."""
    path = Path(path)
    cfg = plan_config(path)
    if not has_shards(path):
        return layout_inputs(cfg, path, f"{path}/config.json")
    ckpt = SafetensorsCheckpoint(path)
    tensors = tuple(StoredTensor(canonical_name(n), ckpt.shape(n), ckpt.dtype_name(n)) for n in ckpt.names())
    files = len({ckpt.file_of(n) for n in ckpt.names()})
    return PlanInputs(cfg, tensors, f"{path}: config.json and the headers of {files} safetensors files", path)


def plan_config(path: Path) -> DeepseekV41Config:
    model_type = model_type_of(path)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"the memory plan covers DeepSeek-V4.1 checkpoints (model_type {' / '.join(MODEL_TYPES)}); "
                         f"{path} holds model_type {model_type!r}")
    return DeepseekV41Config.from_file(path)


def layout_inputs(cfg: DeepseekV41Config, path: Path, where: str) -> PlanInputs:
    return PlanInputs(cfg, tuple(released_layout(cfg)), f"{where} (no shard headers: the released layout assumed)",
                      path)


def hub_plan_inputs(repo_id: str, revision: str | None = None) -> PlanInputs:
    """The inputs of a hub repo without downloading its weights: its JSON files (cached or fetched), and the
    shard headers from the HF cache if the shards are there, else from the hub; offline and uncached, the
    released layout."""
    from huggingface_hub import get_safetensors_metadata, snapshot_download

    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, allow_patterns=["*.json"]))
    except Exception as exc:  # offline and not cached, no such repo, gated, ...
        raise ValueError(f"could not read {repo_id!r}'s config.json from the HF cache or the hub "
                         f"({type(exc).__name__}: {exc}); pass a local directory holding its config.json") from exc
    if all((snapshot / f).is_file() for f in _listed_shards(snapshot)) and has_shards(snapshot):
        return read_plan_inputs(snapshot)
    cfg = plan_config(snapshot)
    try:
        meta = get_safetensors_metadata(repo_id, revision=revision)
    except Exception as exc:  # offline: plan from the layout
        logger.info("could not read %s's shard headers from the hub (%s: %s)", repo_id, type(exc).__name__, exc)
        return layout_inputs(cfg, snapshot, f"{repo_id}'s config.json")
    tensors = tuple(StoredTensor(canonical_name(name), tuple(info.shape), info.dtype)
                    for file in meta.files_metadata.values() for name, info in file.tensors.items())
    return PlanInputs(cfg, tensors, f"{repo_id}: config.json and the headers of {len(meta.files_metadata)} "
                                    "safetensors files (read from the hub)", snapshot)


def _listed_shards(snapshot: Path) -> set[str]:
    from deepinfer.models.checkpoint_files import read_json_object

    index = snapshot / INDEX_FILE
    if not index.is_file():
        return set()
    weight_map = read_json_object(index).get("weight_map")
    return set(weight_map.values()) if isinstance(weight_map, dict) else set()
