"""A checkpoint: one safetensors file, or several tied together by a ``*.index.json``.

The index's ``weight_map`` says which file holds each tensor. Opening a checkpoint validates
the index and the header of every file it names, and checks that the map and the files
agree (each tensor in exactly one file, the one the map names), before any data is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .errors import CheckpointError, shown, shown_value
from .format import MAX_HEADER_BYTES, SafetensorsFile, TensorEntry, open_safetensors, parse_json, require_regular_file

CheckpointPath = str | os.PathLike[str]


def _index_error(path: Path, what: str, tensor: str | None = None) -> CheckpointError:
    t = f", tensor '{shown(tensor)}'" if tensor is not None else ""
    return CheckpointError(f"checkpoint index '{shown(str(path))}'{t}: {what}")


class _Entries(Mapping[str, TensorEntry]):
    """Name -> TensorEntry across the files (each name is in one file: checked at opening),
    looked up in each file's compact table; no per-tensor object is held."""

    def __init__(self, files: list[SafetensorsFile]) -> None:
        self._tables = [f.entries for f in files if f.entries is not None]

    def __getitem__(self, name: str) -> TensorEntry:
        for t in self._tables:
            i = t.index(name) if isinstance(name, str) else -1
            if i >= 0:
                return t.entry_at(i)
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return any(name in t for t in self._tables)

    def __iter__(self) -> Iterator[str]:
        for t in self._tables:
            yield from t

    def __len__(self) -> int:
        return sum(len(t) for t in self._tables)


class Checkpoint:
    """Validated tensors by name, across one or more open files. Close it (or use ``with``).
    ``entries`` is a read-only mapping, name -> TensorEntry."""

    def __init__(self, path: str, files: list[SafetensorsFile], metadata: dict[str, Any] | None) -> None:
        self.path = path
        self.files = files
        self.metadata = metadata
        self.entries = _Entries(files)

    @property
    def nbytes(self) -> int:
        return sum(f.entries.nbytes for f in self.files if f.entries is not None)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> TensorEntry:
        return self.entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, files={len(self.files)}, tensors={len(self.entries)})"


def open_checkpoint(path: CheckpointPath, *, strict: bool = True) -> Checkpoint:
    """Open ``path``: a ``.safetensors`` file, a ``*.index.json``, or a directory holding
    exactly one index (or else exactly one ``.safetensors`` file). ``strict``: see
    :func:`~hsdp.checkpoint.format.open_safetensors` (gaps and trailing bytes refused)."""
    p = _resolve(Path(os.fspath(path)))
    if p.name.endswith(".json"):
        return _open_index(p, strict)
    f = open_safetensors(p, strict=strict)
    return Checkpoint(str(p), [f], f.metadata)


def _resolve(p: Path) -> Path:
    if not p.is_dir():
        if not p.exists():
            raise FileNotFoundError(f"checkpoint '{p}' does not exist")
        return p
    for pattern in ("*.index.json", "*.safetensors"):
        # a folder named *.safetensors is no file; a FIFO is kept, to be refused by name when opened
        found = sorted(f for f in p.glob(pattern) if not f.is_dir())
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = shown(", ".join(f.name for f in found))
            raise CheckpointError(f"checkpoint directory '{p}' holds several {pattern} files ({names}); name one")
    raise FileNotFoundError(f"checkpoint directory '{p}' holds no *.index.json and no *.safetensors file")


def _read_index(path: Path) -> tuple[dict[str, str], dict[str, Any] | None]:
    require_regular_file(path)
    size = path.stat().st_size
    if size > MAX_HEADER_BYTES:  # the header's limit: an index is a header spread over files
        raise _index_error(path, f"the index is {size} bytes, over the {MAX_HEADER_BYTES}-byte limit (corrupt file?)")
    obj = parse_json(path.read_bytes(), lambda k: _index_error(path, "the name appears more than once", k),
                     lambda what: _index_error(path, what))
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict):
        raise _index_error(path, "must be a JSON object with a 'weight_map' object")
    for name, fname in wm.items():
        # Plain file names only: an index must not point outside its own directory.
        if not isinstance(fname, str) or not fname or fname != os.path.basename(fname) or fname in (".", ".."):
            what = f"weight_map entry must be a file name in the index's directory, got {shown_value(fname)}"
            raise _index_error(path, what, name)
    meta = obj.get("metadata")
    return wm, meta if isinstance(meta, dict) else None


def _open_index(path: Path, strict: bool) -> Checkpoint:
    weight_map, metadata = _read_index(path)
    files: list[SafetensorsFile] = []
    try:
        by_name: dict[str, SafetensorsFile] = {}
        for fname in dict.fromkeys(weight_map.values()):  # each file once, in map order
            fp = path.parent / fname
            if not fp.exists():  # present but no regular file: open_safetensors says what it is
                first = next(n for n, v in weight_map.items() if v == fname)
                what = f"the weight_map puts it in '{shown(fname)}', which does not exist in {path.parent}"
                raise _index_error(path, what, first)
            f = open_safetensors(fp, strict=strict)
            files.append(f)
            by_name[fname] = f
        _check_agreement(path, weight_map, by_name)
    except BaseException:
        for f in files:
            f.close()
        raise
    return Checkpoint(str(path), files, metadata)


def _check_agreement(path: Path, weight_map: dict[str, str], files: dict[str, SafetensorsFile]) -> None:
    # Every name in a file must be mapped to that file, so a name in two files fails for one
    # of them; the other way round, every mapped name must be in its file. No set of all
    # names is built: the weight_map already is one.
    for fname, f in files.items():
        for name in f.entries or ():
            if name not in weight_map:
                raise _index_error(path, f"'{shown(fname)}' holds the tensor but the weight_map does not list it", name)
            if weight_map[name] != fname:
                where = weight_map[name]
                if where in files and name in (files[where].entries or ()):
                    what = f"the tensor is stored in both '{shown(where)}' and '{shown(fname)}'"
                else:
                    what = f"the weight_map puts it in '{shown(where)}' but it is stored in '{shown(fname)}'"
                raise _index_error(path, what, name)
    for name, fname in weight_map.items():
        if name not in (files[fname].entries or ()):
            raise _index_error(path, f"the weight_map puts it in '{shown(fname)}', which does not hold it", name)
