"""A Hugging Face hub cache laid out on disk as ``huggingface_hub`` does, for offline tests.

``models--org--name/blobs/<sha256>`` holds each file once; ``snapshots/<commit>/<file>`` are relative symlinks
into ``blobs``; ``refs/<branch or tag>`` holds a commit hash.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def commit_hash(label: str) -> str:
    """A 40-hex commit hash (what the hub's revisions resolve to) derived from ``label``."""
    return hashlib.sha1(label.encode()).hexdigest()


def add_snapshot(cache: Path, repo_id: str, commit: str, source: Path, refs: tuple[str, ...] = ()) -> Path:
    """Put the files of directory ``source`` in ``cache`` as snapshot ``commit`` of ``repo_id``; each name in
    ``refs`` (``"main"``, a tag) then points at it.  Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.iterdir() if p.is_file()):
        data = file.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
