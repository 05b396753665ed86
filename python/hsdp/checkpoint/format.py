"""The safetensors file format: dtype names, header parsing and validation.

A file is an 8-byte little-endian header length N, N bytes of JSON (``name -> {dtype,
shape, data_offsets}`` plus an optional ``__metadata__`` of strings), then the data section;
offsets are relative to its start. The header is parsed with :mod:`json` and every entry is
checked here, before anything reads a byte of data, so the C data path only ever sees
ranges that lie inside the file and match their tensor's shape and dtype.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import DType, as_dtype
from .errors import CheckpointError, describe_file

# The reference implementation's limit; a larger "header" is a corrupt or hostile file.
MAX_HEADER_BYTES = 100_000_000

# safetensors dtype name <-> hsdp dtype name.
_ST_TO_HSDP: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "F64": "float64",
    "U64": "uint64",
    "I64": "int64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_HSDP_TO_ST: dict[str, str] = {v: k for k, v in _ST_TO_HSDP.items()}


def dtype_from_safetensors(name: str) -> DType | None:
    """The hsdp dtype of a safetensors dtype name, None when unknown."""
    h = _ST_TO_HSDP.get(name)
    return as_dtype(h) if h else None


def dtype_to_safetensors(dtype: Any) -> str:
    return _HSDP_TO_ST[as_dtype(dtype).name]


@dataclass(frozen=True, eq=False)
class TensorEntry:
    """One validated tensor: where its bytes are and what they hold."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int
    file: "SafetensorsFile"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def where(self) -> str:
        return f"{describe_file(self.file.path)}, tensor '{self.name}'"

    def __repr__(self) -> str:
        return f"TensorEntry({self.name!r}, {self.dtype.name}, {self.shape}, file={self.file.path!r})"


@dataclass(eq=False)
class SafetensorsFile:
    """An open, validated safetensors file. Holds the descriptor that was validated, so the
    bytes read later come from the same file (not whatever the path names by then)."""

    path: str
    fd: int
    size: int
    data_start: int
    metadata: dict[str, str] | None
    entries: dict[str, TensorEntry] = field(default_factory=dict)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fail(path: str, what: str, tensor: str | None = None) -> CheckpointError:
    where = describe_file(path) + (f", tensor '{tensor}'" if tensor is not None else ", header")
    return CheckpointError(f"{where}: {what}")


def unique_keys(on_duplicate: Callable[[str], Exception]) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A json ``object_pairs_hook`` that raises ``on_duplicate(key)`` for a repeated key: json
    would keep the last one silently, and two tensors (or files) of one name are ambiguous."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise on_duplicate(k)
            out[k] = v
        return out

    return hook


def parse_json(raw: bytes, on_duplicate: Callable[[str], Exception], fail: Callable[[str], Exception]) -> Any:
    """Untrusted JSON (a header, an index) -> objects, every failure raised as ``fail(what)``:
    invalid UTF-8 or JSON, a repeated key (``on_duplicate(key)``), and what json itself
    refuses with ValueError/RecursionError (a 5000-digit integer, nesting past the stack)."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys(on_duplicate))
    except CheckpointError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"not valid UTF-8 JSON: {e}") from None
    except (ValueError, RecursionError) as e:
        raise fail(f"cannot be parsed: {type(e).__name__}: {str(e)[:200]}") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_entry(
    path: str, name: str, info: Any, data_len: int, data_start: int
) -> tuple[DType, tuple[int, ...], int, int]:
    if not name:
        raise _fail(path, "a tensor has an empty name", name)
    if not isinstance(info, dict):
        raise _fail(path, f"entry must be an object with dtype, shape and data_offsets, got {info!r}", name)
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise _fail(path, f"entry has no '{key}'", name)
    st = info["dtype"]
    dtype = dtype_from_safetensors(st) if isinstance(st, str) else None
    if dtype is None:
        raise _fail(path, f"unknown dtype {st!r} (known: {', '.join(_ST_TO_HSDP)})", name)
    shape = info["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _fail(path, f"shape must be a list of non-negative integers, got {shape!r}", name)
    offs = info["data_offsets"]
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
        raise _fail(path, f"data_offsets must be [begin, end] integers, got {offs!r}", name)
    begin, end = offs
    if begin < 0 or end < begin:
        raise _fail(path, f"data_offsets {offs} are not 0 <= begin <= end", name)
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise _fail(
            path,
            f"shape {tuple(shape)} of {st} needs {expected} bytes but data_offsets {offs} span {end - begin}",
            name,
        )
    if end > data_len:
        raise _fail(
            path,
            f"data_offsets {offs} run past the end of the data section ({data_len} bytes from byte "
            f"{data_start}; the file is truncated or the offsets are wrong)",
            name,
        )
    return dtype, tuple(shape), begin, end


def _check_overlaps(path: str, ranges: list[tuple[int, int, str]]) -> None:
    prev_end, prev_name = 0, ""
    for begin, end, name in sorted(r for r in ranges if r[1] > r[0]):  # empty ranges hold nothing
        if begin < prev_end:
            raise _fail(path, f"its bytes [{begin}, {end}) overlap those of tensor '{prev_name}'", name)
        prev_end, prev_name = end, name


def _parse_metadata(path: str, meta: Any) -> dict[str, str] | None:
    if meta is None:
        return None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _fail(path, f"__metadata__ must map strings to strings, got {meta!r}")
    return meta


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def require_regular_file(path: str | os.PathLike[str], mode: int | None = None) -> None:
    """CheckpointError unless `path` (or an already taken st_mode) is a regular file. Checked
    before opening: opening a FIFO blocks until a writer comes, maybe forever."""
    p = os.fspath(path)
    if mode is None:
        mode = os.stat(p).st_mode  # FileNotFoundError for a missing file, as open would
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise CheckpointError(f"checkpoint file '{p}' is {kind}, not a regular file: refused before opening it "
                              "(reading it could block forever or never end)")


def open_safetensors(path: str | os.PathLike[str]) -> SafetensorsFile:
    """Open and validate one file: its header only, no tensor data is read.

    Raises :class:`CheckpointError` naming the file and the offending tensor for any
    malformed entry, or when it is no regular file (a FIFO, a device); OSError when the file
    cannot be opened.
    """
    p = os.fspath(path)
    require_regular_file(p)
    # O_NONBLOCK: should the path become a FIFO between the check and the open, the open
    # returns at once (and fstat refuses it); on a regular file it changes nothing.
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        require_regular_file(p, os.fstat(fd).st_mode)
        return _validate(p, fd)
    except BaseException:
        os.close(fd)
        raise


def _validate(path: str, fd: int) -> SafetensorsFile:
    size = os.fstat(fd).st_size
    if size < 8:
        raise _fail(path, f"the file is {size} bytes, too short for the 8-byte header length (truncated?)")
    (hlen,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if hlen > MAX_HEADER_BYTES:
        raise _fail(path, f"header length {hlen} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt file?)")
    if 8 + hlen > size:
        raise _fail(path, f"header length {hlen} runs past the end of the {size}-byte file (truncated?)")
    raw = os.pread(fd, hlen, 8)
    if len(raw) != hlen:
        raise _fail(path, f"read {len(raw)} of the {hlen} header bytes (the file shrank?)")
    obj = parse_json(raw, lambda k: _fail(path, "the name appears more than once in the header", k),
                     lambda what: _fail(path, what))
    if not isinstance(obj, dict):
        raise _fail(path, f"the header must be a JSON object, got {type(obj).__name__}")
    metadata = _parse_metadata(path, obj.pop("__metadata__", None))
    data_start = 8 + hlen
    data_len = size - data_start
    f = SafetensorsFile(path=path, fd=fd, size=size, data_start=data_start, metadata=metadata)
    ranges: list[tuple[int, int, str]] = []
    for name, info in obj.items():
        dtype, shape, begin, end = _check_entry(path, name, info, data_len, data_start)
        ranges.append((begin, end, name))
        f.entries[name] = TensorEntry(name, dtype, shape, data_start + begin, end - begin, f)
    _check_overlaps(path, ranges)
    return f
