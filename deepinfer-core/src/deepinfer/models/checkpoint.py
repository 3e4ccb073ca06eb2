"""Read safetensors checkpoints (one file, or shards listed by ``model.safetensors.index.json``).

Only safetensors are read: nothing is ever unpickled.  Tensors are fetched lazily by name, so a loader
can check every name and shape from the headers before reading any data.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer.models.checkpoint_files import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

__all__ = ["INDEX_FILE", "SINGLE_FILE", "CheckpointError", "SafetensorsCheckpoint"]


class SafetensorsCheckpoint:
    """Tensor names, shapes and dtypes from the headers; tensor data on demand."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._file_of = self._locate_tensors()
        self._handles: dict[Path, object] = {}

    def _locate_tensors(self) -> dict[str, Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            missing = sorted({f for f in weight_map.values() if not (self.directory / f).is_file()})
            if missing:
                raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
            return {name: self.directory / f for name, f in weight_map.items()}
        files = [self.directory / SINGLE_FILE] if (self.directory / SINGLE_FILE).is_file() else []
        files = files or sorted(self.directory.glob("*.safetensors"))
        if len(files) != 1:
            others = sorted(p.name for p in self.directory.iterdir()) if self.directory.is_dir() else []
            raise CheckpointError(
                f"{self.directory}: expected {SINGLE_FILE} or {INDEX_FILE} (safetensors only; pickled "
                f"checkpoints are never loaded); found {others}"
            )
        with safe_open(files[0], framework="pt") as f:
            return {name: files[0] for name in f.keys()}

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._file_of[name]).get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype string (``F32``, ``BF16``, ``F8_E4M3``, ``F8_E8M0``, ``I8``, ``U8``, ...)."""
        return self._handle(self._file_of[name]).get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self._file_of[name]).get_tensor(name)
