"""A Hugging Face hub cache laid out by hand, for tests that must not touch the network:
``models--ORG--NAME/snapshots/COMMIT/...`` holding a folder's files, and ``refs/BRANCH``
naming the commit, as ``huggingface_hub`` leaves them after a download. With ``HF_HUB_CACHE``
pointing at the cache (and ``HF_HUB_OFFLINE=1``), ``org/name`` resolves to the snapshot."""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["place_in_cache"]


def place_in_cache(folder: str | Path, cache: str | Path, repo_id: str, commit: str = "0" * 40,
                   branches: tuple[str, ...] = ("main",)) -> Path:
    """Copies ``folder`` into ``cache`` as the snapshot ``commit`` of the model ``repo_id``
    (``org/name``), each of ``branches`` pointing at it; returns the snapshot folder."""
    org, sep, name = repo_id.partition("/")
    if not sep or not org or not name or "/" in name:
        raise ValueError(f"repo_id must be 'org/name', got {repo_id!r}")
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise ValueError(f"commit must be 40 lowercase hex digits (a git commit), got {commit!r}")
    repo = Path(cache) / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for branch in branches:
        (repo / "refs" / branch).write_text(commit)
    return snapshot
