"""A checkpoint directory's plain files, read safely: regular files only, JSON parsed with the file named.

A FIFO or a directory where a file should be would make a reader hang or fail with a message that names
nothing; every reader here checks first, and every error names the file.  Symlinks are followed (a Hugging
Face snapshot is symlinks into the cache's blob store).
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """The checkpoint's files or tensors do not match what the model needs; the message names them."""


#: JSON files of a checkpoint that must each hold one object; any other ``*.json`` must at least parse.
JSON_OBJECT_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer_config.json")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def regular_file(path: Path) -> Path:
    """``path`` if it is (or links to) a regular file; else :class:`CheckpointError` saying what it is."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        broken = " (a broken symlink)" if path.is_symlink() else ""
        raise CheckpointError(f"{path}: does not exist{broken}") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: expected a regular file, found {_kind(mode)}")
    return path


def read_json(path: Path) -> Any:
    """The parsed JSON of ``path``; an unreadable file or invalid JSON raises naming the file and the spot."""
    try:
        text = regular_file(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read as UTF-8 text ({exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise CheckpointError(f"{path}: invalid JSON: nested too deeply") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """``read_json`` for files that must hold one JSON object (config.json, the safetensors index, ...)."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object at the top level, found {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def check_json_files(directory: Path) -> None:
    """Every ``*.json`` of the checkpoint is a regular file of valid JSON, and the ones in
    :data:`JSON_OBJECT_FILES` hold objects, so later readers (transformers' tokenizer among them) cannot fail
    on them without naming the file, or hang on a FIFO."""
    for path in sorted(directory.glob("*.json")):
        if path.name in JSON_OBJECT_FILES:
            read_json_object(path)
        else:
            read_json(path)
