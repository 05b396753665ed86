"""Hugging Face hub ids (``org/name``) wherever hsdp takes a model folder: ``--model`` of
``hsdp generate`` and ``hsdp serve``, :func:`hsdp.pipelines.load_pipeline` and
:class:`hsdp.Omni`. Every front end calls :func:`resolve_model` (or, inside a running job,
:func:`resolve_model_on_ranks`), so an id means one thing everywhere.

What an id resolves to: the snapshot folder of the local Hugging Face cache
(``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``, read when the
call is made), at ``revision`` (a branch, a tag or a commit; default ``main``). When it is
not there and downloads are allowed (``HF_HUB_OFFLINE`` unset and ``download`` not False),
``huggingface_hub.snapshot_download`` fetches it; offline, :class:`HubError` names the
command that downloads it. A text that is an existing path, or not of the form ``org/name``,
is a folder and is returned as given (the folder checks then say what is wrong with it).

[Note: one snapshot per job] A branch moves: two ranks that each read ``refs/main`` may see
two commits if a download lands in between. So a job resolves an id once: the self-launching
commands and ``Omni`` resolve it before the ranks start and hand them the snapshot folder
(:func:`pin_model_argv`); ``load_pipeline``, already inside the ranks, resolves on rank 0 and
the others resolve the commit rank 0 found (:func:`resolve_model_on_ranks`).

No torch here; ``huggingface_hub`` is imported only when an id is resolved.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["HubError", "cache_dir", "download_command", "is_hub_id", "offline", "pin_model_argv", "resolve_model",
           "resolve_model_on_ranks"]

# org/name as the hub spells repository ids (letters, digits, '-', '_', '.'; no leading '.').
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_TRUE = ("1", "on", "yes", "true")


class HubError(ValueError):
    """A hub id that cannot be resolved; the message says why and what to run."""


def is_hub_id(model: str | os.PathLike[str]) -> bool:
    """Whether ``model`` names a hub repository (``org/name``) rather than a folder: it has
    that form and no such path exists here."""
    text = os.fspath(model)
    return bool(_HUB_ID.fullmatch(text)) and not os.path.exists(text)


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The hub cache folder huggingface_hub uses, from the environment as it is now."""
    env = os.environ if environ is None else environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def offline(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the user turned the hub's network off (``HF_HUB_OFFLINE``)."""
    env = os.environ if environ is None else environ
    return env.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def download_command(repo_id: str, revision: str | None = None) -> str:
    """The shell command that puts ``repo_id`` in the cache."""
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def _local_snapshot(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """The cached snapshot folder, or None when the cache lacks it (no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def resolve_model(model: str | os.PathLike[str], revision: str | None = None, *,
                  download: bool | None = None, what: str = "model") -> Path:
    """The folder ``model`` names: itself, or the cached snapshot of the hub id it is.

    ``revision``: the hub branch, tag or commit (only for a hub id). ``download``: None
    (default) downloads a missing snapshot unless ``HF_HUB_OFFLINE`` is set; False never
    does; True always may. ``what`` names the argument in messages (``--model``)."""
    text = os.fspath(model)
    if not is_hub_id(text):
        if revision is not None:
            raise HubError(f"{what} {text!r} is a folder, not a hub id (org/name), so revision={revision!r} "
                           "cannot apply; drop the revision or give the hub id")
        return Path(text)
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise HubError(f"{what} {text!r} is a Hugging Face hub id, and resolving it needs huggingface_hub "
                       "(pip install huggingface_hub; diffusers installs it), or give a local folder") from None
    cache = cache_dir()
    found = _local_snapshot(text, revision, cache)
    if found is not None:
        return found
    at = f" at revision {revision!r}" if revision else ""
    hint = f"download it first with `{download_command(text, revision)}`, or give a local pipeline folder"
    if download is False or (download is None and offline()):
        why = "downloads are off (HF_HUB_OFFLINE is set)" if download is None else "downloads are off here"
        raise HubError(f"{what} {text!r}{at} is not in the Hugging Face cache {cache}, and {why}; {hint}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, revision=revision, cache_dir=cache))
    except Exception as exc:  # any failure of the download gets the same advice
        raise HubError(f"{what} {text!r}{at} is not in the Hugging Face cache {cache}, and downloading it failed "
                       f"({type(exc).__name__}: {exc}); {hint}") from exc


def resolve_model_on_ranks(model: str | os.PathLike[str], revision: str | None, world: Any,
                           what: str = "model") -> Path:
    """:func:`resolve_model` inside a running job: rank 0 resolves (downloading where
    allowed), every other rank resolves the commit rank 0 found, so all load one snapshot.
    A failure on rank 0 raises the same :class:`HubError` on every rank; a failure on
    another rank raises on every rank, naming that rank (the ranks never wait on each other)."""
    text = os.fspath(model)
    if world.size == 1 or not is_hub_id(text):
        return resolve_model(text, revision, what=what)
    reply: dict[str, str | None] = {"commit": None, "error": None}
    found: Path | None = None
    if world.rank == 0:
        try:
            found = resolve_model(text, revision, what=what)
            reply["commit"] = found.name  # snapshots/<commit>
        except HubError as exc:
            reply["error"] = str(exc)
    reply = _broadcast_json(world, reply)
    if reply["error"] is not None:
        raise HubError(reply["error"])
    err: BaseException | None = None
    if world.rank != 0:
        try:
            found = resolve_model(text, reply["commit"], what=what)
        except HubError as exc:
            err = exc
    # the loader's agreement: this rank's error, or one naming the rank
    from .checkpoint.stream import _Agreement

    _Agreement(world)(err, 0, f"resolving {what} {text!r}")
    assert found is not None
    return found


def _broadcast_json(world: Any, message: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's ``message`` on every rank of ``world`` (its length, then its bytes)."""
    from hsdp.world.messages import broadcast_bytes

    return json.loads(broadcast_bytes(world, json.dumps(message).encode("utf-8") if world.rank == 0 else None))


def pin_model_argv(argv: Sequence[str], folder: str | os.PathLike[str], served_name: str | None = None) -> list[str]:
    """A command line whose ``--model`` names ``folder`` (the snapshot the parent resolved)
    and has no ``--revision``: what a self-launching command hands its ranks, so that every
    rank loads that snapshot and none resolves (or downloads) the id again. ``served_name``
    (``hsdp serve``: the hub id, not the snapshot's commit) is passed as
    ``--served-model-name`` unless the line has one."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out += args[i:]
            break
        if arg in ("--model", "--revision"):
            if arg == "--model":
                out += ["--model", os.fspath(folder)]
            i += 2
            continue
        if arg.startswith("--model="):
            out.append(f"--model={os.fspath(folder)}")
        elif not arg.startswith("--revision="):
            out.append(arg)
        i += 1
    if served_name is not None and not any(a == "--served-model-name" or a.startswith("--served-model-name=")
                                           for a in out):
        out += ["--served-model-name", served_name]
    return out


def resolve_model_flag(model: str | os.PathLike[str], revision: str | None) -> Path:
    """``--model`` (and ``--revision``) of a command: resolved in this process. From a plain
    shell the command then starts its ranks with the snapshot folder (:func:`pin_model_argv`);
    inside a job a launcher started, each rank resolves the cache alone, so none downloads
    (several ranks would race to): a missing snapshot is an error naming the download command."""
    from .world.job import launch_info

    in_job = launch_info().via != "single"
    return resolve_model(model, revision, download=False if in_job else None, what="--model")
