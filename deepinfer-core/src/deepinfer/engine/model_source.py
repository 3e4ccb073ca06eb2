"""Where the weights come from: a local directory, a Hugging Face repo id, or the embedded tiny model.

``LLM(model=...)``:

- a local directory (``config.json`` + ``*.safetensors`` + tokenizer files) is used as is;
- a repo id (``org/name``) is fetched with ``huggingface_hub`` into the standard HF cache (or found
  there when offline); if neither works, the error says how to point at local weights.  ``revision`` (a
  branch, tag or commit) pins what is fetched; the commit actually used is logged and kept in
  :attr:`ModelSource.commit`;
- ``None``: ``DEEPINFER_HF_MODEL_DIR`` if set; else any complete revision of ``deepseek-ai/DeepSeek-V4.1-Flash*``
  in the HF cache (``DEFAULT_MODEL`` first; of a repo, the revision ``main`` names first, then the newest;
  logged); else the tiny DeepSeek-V4.1 checkpoint shipped in the package (logged).  ``None`` never starts a
  download: the default model is hundreds of GB; ask for it by name.

A download fetches the checkpoint's files (:data:`CHECKPOINT_PATTERNS`): the JSON files (config, shard index,
tokenizer), the shards, the tokenizer, and ``encoding/*`` (the release's chat format, read by people and tests;
DeepInfer never executes it, nor any other code from a checkpoint).

Whatever the source, the directory's JSON files are checked here (regular files, valid JSON, objects where
one is expected), before anything else reads them.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from deepinfer import envs
from deepinfer.models.checkpoint_files import check_json_files, read_json_object
from deepinfer.models.config_fields import Fields

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
#: Repos whose cached revisions ``LLM()`` uses when no model is named (the released repo and its dated names).
DEFAULT_REPOS = "deepseek-ai/DeepSeek-V4.1-Flash*"
EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_v41"
#: Files a checkpoint needs; nothing else of a repo is downloaded.
CHECKPOINT_PATTERNS = ["*.json", "model.safetensors.index.json", "*.safetensors", "tokenizer*", "*.model", "*.txt",
                       "encoding/*"]

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
    #: How it was found, for logs: "local directory", "HF hub (org/name@commit)", "embedded", ...
    origin: str
    #: The Hub commit the files are from (the snapshot's name in the HF cache); None when not from the Hub.
    commit: str | None = None


def _checked_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise ModelSourceError(f"{what} {str(path)!r} is not a directory; {_HOW_TO_POINT}")
    config = path / "config.json"
    if not (config.exists() or config.is_symlink()):
        raise ModelSourceError(f"{what} {str(path)!r} has no config.json; is it a Hugging Face checkpoint directory?")
    check_json_files(path)
    _check_generation_config(path / "generation_config.json")
    return path


def _check_generation_config(path: Path) -> None:
    """The token ids the engine takes from generation_config.json (EOS first of all) are ids or null."""
    if not path.is_file():
        return
    fields = Fields.of(read_json_object(path), str(path))
    fields.optional_ids("eos_token_id")
    fields.optional_integer("bos_token_id", lo=0)
    fields.optional_integer("pad_token_id", lo=0)


def _hub_source(repo_id: str, revision: str | None, path: Path, origin: str) -> ModelSource:
    """The snapshot ``path`` of ``repo_id`` as a source; its directory name is the commit (HF cache layout)."""
    commit = path.name
    _checked_dir(path, f"snapshot of {repo_id}")
    pinned = f" (revision {revision!r})" if revision is not None else ""
    logger.info("%s: using commit %s%s from %s", repo_id, commit, pinned, path)
    return ModelSource(path, f"{origin} ({repo_id}@{commit})", commit)


def _from_hub(repo_id: str, revision: str | None, local_files_only: bool) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_PATTERNS,
                                  local_files_only=local_files_only))


def _fetch(repo_id: str, revision: str | None) -> ModelSource:
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision is not None else ""
    try:
        path = _from_hub(repo_id, revision, False)
    except GatedRepoError as exc:
        raise ModelSourceError(f"{repo_id!r} is gated on the Hugging Face Hub; log in (`hf auth login`) after "
                               f"accepting its terms, or {_HOW_TO_POINT}") from exc
    except RevisionNotFoundError as exc:
        raise ModelSourceError(f"{repo_id!r} has no revision {revision!r} on the Hugging Face Hub "
                               "(a branch, tag or commit hash)") from exc
    except RepositoryNotFoundError as exc:
        raise ModelSourceError(f"{repo_id!r} was not found on the Hugging Face Hub (or is private); "
                               f"check the name, or {_HOW_TO_POINT}") from exc
    except (LocalEntryNotFoundError, OSError) as exc:
        raise ModelSourceError(f"could not fetch {repo_id!r}{at} from the Hugging Face Hub and it is not in the "
                               f"local HF cache (no network? {exc.__class__.__name__}); {_HOW_TO_POINT}") from exc
    return _hub_source(repo_id, revision, path, "HF hub")


def cached_default() -> ModelSource | None:
    """A complete cached revision of :data:`DEFAULT_REPOS` (see the module docstring), or None."""
    from huggingface_hub import constants

    owner, pattern = DEFAULT_REPOS.split("/")
    cache = Path(constants.HF_HUB_CACHE)
    default = _cache_dir(DEFAULT_MODEL)
    repos = sorted(cache.glob(f"models--{owner}--{pattern}"), key=lambda p: (p.name != default, p.name))
    for repo in repos:
        repo_id = repo.name.removeprefix("models--").replace("--", "/", 1)
        for snapshot in _revisions(repo):
            missing = _missing_files(snapshot)
            if missing is None:
                return _hub_source(repo_id, None, snapshot, "HF cache")
            logger.info("%s@%s in the HF cache is incomplete (%s): not used", repo_id, snapshot.name, missing)
    return None


def _cache_dir(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def _revisions(repo: Path) -> list[Path]:
    """A cached repo's snapshots: the one ``refs/main`` names, then the other refs', then the rest, newest first."""
    snapshots = sorted((p for p in (repo / "snapshots").glob("*") if p.is_dir()), key=lambda p: -p.stat().st_mtime)
    refs = sorted((repo / "refs").glob("*"), key=lambda p: p.name != "main") if (repo / "refs").is_dir() else []
    named = [repo / "snapshots" / ref.read_text().strip() for ref in refs if ref.is_file()]
    return list(dict.fromkeys([p for p in named if p.is_dir()] + snapshots))


def _missing_files(snapshot: Path) -> str | None:
    """What a cached snapshot lacks to be loaded (None: nothing): config.json, or shards its index lists."""
    if not (snapshot / "config.json").is_file():
        return "no config.json"
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        shards = set(weight_map.values()) if isinstance(weight_map, dict) else set()
        absent = sorted(s for s in shards if not (snapshot / str(s)).is_file())
        return f"{len(absent)} of {len(shards)} shards missing" if absent else None
    return None if any(snapshot.glob("*.safetensors")) else "no safetensors files"


def resolve_model(model: str | os.PathLike | None, revision: str | None = None) -> ModelSource:
    """Find the checkpoint directory for ``LLM(model=...)`` (see the module docstring).  ``revision`` pins a
    repo id's branch, tag or commit; with anything but a repo id it raises rather than being ignored."""
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision must be a branch, tag or commit hash (a string), got {type(revision).__name__}")
    if revision is not None and not revision.strip():
        raise ValueError("revision must be a branch, tag or commit hash, got an empty string")
    if model is not None:
        text = os.fspath(model)
        path = Path(text).expanduser()
        if path.exists():
            if revision is not None:
                raise ValueError(f"revision={revision!r} pins a Hugging Face repo id, but model={text!r} is a local "
                                 "directory (its files are used as they are); drop revision=")
            return ModelSource(_checked_dir(path, "model directory"), "local directory")
        if _REPO_ID.match(text) and not text.startswith((".", "~")):
            return _fetch(text, revision)
        raise ModelSourceError(f"model={text!r} is neither an existing directory nor a Hugging Face repo id "
                               f"('org/name'); {_HOW_TO_POINT}")
    if revision is not None:
        raise ValueError(f"revision={revision!r} needs a repo id: pass model='org/name' "
                         f"(e.g. model='{DEFAULT_MODEL}') with it")
    env_dir = envs.hf_model_dir()
    if env_dir is not None:
        return ModelSource(_checked_dir(Path(env_dir).expanduser(), "DEEPINFER_HF_MODEL_DIR"), "DEEPINFER_HF_MODEL_DIR")
    cached = cached_default()
    if cached is not None:
        return cached
    if not (EMBEDDED_MODEL_DIR / "config.json").is_file():
        raise ModelSourceError(f"no model configured and the embedded tiny model is missing from {EMBEDDED_MODEL_DIR}; "
                               f"pass model='{DEFAULT_MODEL}' to download the default, or {_HOW_TO_POINT}")
    logger.info("no model configured and no revision of %s is in the HF cache: using the embedded tiny DeepSeek-V4.1 "
                "checkpoint (a toy for smoke tests); pass model=... or set DEEPINFER_HF_MODEL_DIR for real weights",
                DEFAULT_REPOS)
    return ModelSource(_checked_dir(EMBEDDED_MODEL_DIR, "embedded model"), "embedded")
