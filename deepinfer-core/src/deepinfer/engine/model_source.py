"""Where the weights come from: a local directory, a Hugging Face repo id, or the embedded tiny model.

``LLM(model=...)``:

- a local directory (``config.json`` + ``*.safetensors`` + tokenizer files) is used as is;
- a repo id (``org/name``) is fetched with ``huggingface_hub`` into the standard HF cache (or found
  there when offline); if neither works, the error says how to point at local weights;
- ``None``: ``DEEPINFER_HF_MODEL_DIR`` if set; else the default repo (``DEFAULT_MODEL``) if it is
  already in the HF cache; else the tiny DeepSeek-V4 checkpoint shipped in the package (logged).
  ``None`` never starts a download: the default model is hundreds of GB; ask for it by name.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from deepinfer import envs

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_v4"
#: Files a checkpoint needs; nothing else of a repo is downloaded.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HOW_TO_POINT = (
    "point DeepInfer at local weights: LLM(model='/path/to/checkpoint') or DEEPINFER_HF_MODEL_DIR=/path/to/checkpoint "
    "(a directory with config.json, *.safetensors and the tokenizer files)"
)


class ModelSourceError(RuntimeError):
    """The model could not be found; the message says what to do."""


@dataclass(slots=True, frozen=True)
class ModelSource:
    path: Path
    #: How it was found, for logs: "local directory", "HF cache", "embedded", ...
    origin: str


def _checked_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise ModelSourceError(f"{what} {str(path)!r} is not a directory; {_HOW_TO_POINT}")
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"{what} {str(path)!r} has no config.json; is it a Hugging Face checkpoint directory?")
    return path


def _from_hub(repo_id: str, revision: str | None, local_files_only: bool) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_PATTERNS,
                                  local_files_only=local_files_only))


def _fetch(repo_id: str, revision: str | None) -> ModelSource:
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return ModelSource(_checked_dir(_from_hub(repo_id, revision, False), f"snapshot of {repo_id}"), "HF hub")
    except GatedRepoError as exc:
        raise ModelSourceError(f"{repo_id!r} is gated on the Hugging Face Hub; log in (`hf auth login`) after "
                               f"accepting its terms, or {_HOW_TO_POINT}") from exc
    except RepositoryNotFoundError as exc:
        raise ModelSourceError(f"{repo_id!r} was not found on the Hugging Face Hub (or is private); "
                               f"check the name, or {_HOW_TO_POINT}") from exc
    except (LocalEntryNotFoundError, OSError) as exc:
        raise ModelSourceError(f"could not fetch {repo_id!r} from the Hugging Face Hub and it is not in the local "
                               f"HF cache (no network? {exc.__class__.__name__}); {_HOW_TO_POINT}") from exc


def _cached(repo_id: str) -> Path | None:
    try:
        path = _from_hub(repo_id, None, True)
    except Exception:  # not cached (or an unusable cache entry): fall through
        return None
    return path if (path / "config.json").is_file() else None


def resolve_model(model: str | os.PathLike | None, revision: str | None = None) -> ModelSource:
    """Find the checkpoint directory for ``LLM(model=...)`` (see the module docstring)."""
    if model is not None:
        text = os.fspath(model)
        path = Path(text).expanduser()
        if path.exists():
            return ModelSource(_checked_dir(path, "model directory"), "local directory")
        if _REPO_ID.match(text) and not text.startswith((".", "~")):
            return _fetch(text, revision)
        raise ModelSourceError(f"model={text!r} is neither an existing directory nor a Hugging Face repo id "
                               f"('org/name'); {_HOW_TO_POINT}")
    env_dir = envs.hf_model_dir()
    if env_dir is not None:
        return ModelSource(_checked_dir(Path(env_dir).expanduser(), "DEEPINFER_HF_MODEL_DIR"), "DEEPINFER_HF_MODEL_DIR")
    cached = _cached(DEFAULT_MODEL)
    if cached is not None:
        return ModelSource(cached, f"HF cache ({DEFAULT_MODEL})")
    if not (EMBEDDED_MODEL_DIR / "config.json").is_file():
        raise ModelSourceError(f"no model configured and the embedded tiny model is missing from {EMBEDDED_MODEL_DIR}; "
                               f"pass model='{DEFAULT_MODEL}' to download the default, or {_HOW_TO_POINT}")
    logger.info("no model configured and %s is not in the HF cache: using the embedded tiny DeepSeek-V4 checkpoint "
                "(a toy for smoke tests); pass model=... or set DEEPINFER_HF_MODEL_DIR for real weights", DEFAULT_MODEL)
    return ModelSource(EMBEDDED_MODEL_DIR, "embedded")
