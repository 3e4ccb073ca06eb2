"""Read safetensors checkpoints (one file, or shards listed by ``model.safetensors.index.json``).

Only safetensors are read: nothing is ever unpickled.  Tensors are fetched lazily by name, so a loader
can check every name, shape and dtype from the headers before reading any data.  Opening checks the files
themselves: every shard is a regular file inside the checkpoint directory with a readable header, and holds
the tensors the index says it does; each error names the file.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from deepinfer.models.checkpoint_files import CheckpointError, read_json_object, regular_file

__all__ = ["INDEX_FILE", "SINGLE_FILE", "CheckpointError", "SafetensorsCheckpoint", "shard_name_problem"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def shard_name_problem(name: object) -> str | None:
    """Why an index's shard name would leave the checkpoint directory (None: it is fine).

    The *name* is checked, not where it resolves to: a Hugging Face snapshot's files are symlinks into the
    cache's blob store, outside the snapshot directory, and must keep loading.
    """
    if not isinstance(name, str) or not name:
        return "is not a file name"
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
        return "is an absolute path"
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        return "leaves the checkpoint directory (..)"
    return None


class SafetensorsCheckpoint:
    """Tensor names, shapes and dtypes from the headers; tensor data on demand."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._handles: dict[Path, Any] = {}
        self._file_of = self._locate_tensors()

    def _locate_tensors(self) -> dict[str, Path]:
        index = self.directory / INDEX_FILE
        if index.exists() or index.is_symlink():
            return self._from_index(index)
        single = self.directory / SINGLE_FILE
        if single.exists() or single.is_symlink():
            files = [single]
        else:
            files = sorted(self.directory.glob("*.safetensors"))
        if len(files) != 1:
            others = sorted(p.name for p in self.directory.iterdir()) if self.directory.is_dir() else []
            raise CheckpointError(
                f"{self.directory}: expected {SINGLE_FILE} or {INDEX_FILE} (safetensors only; pickled "
                f"checkpoints are never loaded); found {others}"
            )
        return dict.fromkeys(self._handle(files[0]).keys(), files[0])

    def _from_index(self, index: Path) -> dict[str, Path]:
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: expected a non-empty \"weight_map\" object (tensor name -> shard file)")
        for tensor, shard in weight_map.items():
            problem = shard_name_problem(shard)
            if problem is not None:
                raise CheckpointError(f"{index}: weight_map[{tensor!r}] = {shard!r} {problem}; shards must be "
                                      "named relative to the checkpoint directory")
        file_of = {name: self.directory / shard for name, shard in weight_map.items()}
        for path in sorted(set(file_of.values())):
            stored = set(self._handle(path).keys())
            absent = sorted(name for name, where in file_of.items() if where == path and name not in stored)
            if absent:
                more = f" and {len(absent) - 5} more" if len(absent) > 5 else ""
                raise CheckpointError(f"{index} lists tensors that {path.name} does not hold: {absent[:5]}{more}")
        return file_of

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            regular_file(path)
            try:
                self._handles[path] = safe_open(path, framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
        return self._handles[path]

    def file_of(self, name: str) -> Path:
        """The file holding tensor ``name``."""
        return self._file_of[name]

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._file_of[name]).get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype string (``F32``, ``BF16``, ``F8_E4M3``, ``F8_E8M0``, ``I8``, ``U8``, ...)."""
        return self._handle(self._file_of[name]).get_slice(name).get_dtype()

    def get(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name``, or only its ``rows`` (a slice of the first dim): the file is memory-mapped, so a row
        slice reads those rows' bytes and no others."""
        path = self._file_of[name]
        try:
            if rows is None:
                return self._handle(path).get_tensor(name)
            return self._handle(path).get_slice(name)[rows]
        except (SafetensorError, OSError, RuntimeError, TypeError) as exc:
            raise CheckpointError(f"{path}: {name}: cannot be read ({exc})") from None
