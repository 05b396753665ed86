"""The safetensors file format: dtype names, header parsing and validation.

A file is an 8-byte little-endian header length N, N bytes of JSON (``name -> {dtype,
shape, data_offsets}`` plus an optional ``__metadata__`` of strings), then the data section;
offsets are relative to its start. Every entry is checked here, before anything reads a
byte of data, so the C data path only ever sees ranges that lie inside the file and match
their tensor's shape and dtype.

Bounded memory: the header is read and parsed a window at a time (``_Reader``), one
top-level member at a time with :mod:`json`'s own scanner, and each validated entry goes
into a few flat arrays (``EntryTable``: about 60 bytes per tensor plus its name), not into a
Python object per tensor. ``TensorEntry`` objects are made only for the tensors asked for.
A header of a million tensors so costs tens of MB, not a GB (docs/design.md).
"""

from __future__ import annotations

import array
import codecs
import json
import json.decoder
import json.scanner
import math
import os
import re
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..engine.dtypes import DType, as_dtype
from .errors import CheckpointError, cut, describe_file, shown, shown_value

# The reference implementation's limit; a larger "header" is a corrupt or hostile file.
MAX_HEADER_BYTES = 100_000_000
# NumPy's most dimensions; a tensor's non-zero dims times its itemsize must fit in int64.
MAX_NDIM = 64
_MAX_BYTES = 2**63 - 1
_WINDOW_BYTES = 1 << 20  # header bytes read at a time

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
_ST_NAMES = tuple(_ST_TO_HSDP)  # the code an EntryTable stores is an index into this
_ST_CODE = {n: i for i, n in enumerate(_ST_NAMES)}
_ITEMSIZE = tuple(as_dtype(_ST_TO_HSDP[n]).itemsize for n in _ST_NAMES)


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
        return f"{describe_file(self.file.path)}, tensor '{shown(self.name)}'"

    def __repr__(self) -> str:
        return f"TensorEntry({shown(self.name)!r}, {self.dtype.name}, {self.shape}, file={self.file.path!r})"


class EntryTable(Mapping[str, TensorEntry]):
    """A file's validated tensors, name -> :class:`TensorEntry`, held as flat arrays: the
    names' UTF-8 bytes end to end, and per tensor a dtype code, its dims, its data offsets
    and the hash of its name (sorted, for lookups). Entries are made when asked for."""

    def __init__(self, file: "SafetensorsFile", b: "_Builder") -> None:
        self._file = file
        self._blob = bytes(b.names)
        self._name_ends = np.frombuffer(b.name_ends, dtype=np.int32)
        self._codes = np.frombuffer(b.codes, dtype=np.uint8)
        self._dims = np.frombuffer(b.dims, dtype=np.int64)
        self._dim_ends = np.frombuffer(b.dim_ends, dtype=np.int32)
        self.begin = np.frombuffer(b.begin, dtype=np.int64)  # relative to the data section
        self.end = np.frombuffer(b.end, dtype=np.int64)
        hashes = np.frombuffer(b.hashes, dtype=np.int64)
        self._order = np.argsort(hashes, kind="stable").astype(np.int32)
        self._sorted = hashes[self._order]

    def __len__(self) -> int:
        return len(self._codes)

    @property
    def nbytes(self) -> int:
        return int((self.end - self.begin).sum())

    def name_at(self, i: int) -> str:
        s = int(self._name_ends[i - 1]) if i else 0
        return self._blob[s : int(self._name_ends[i])].decode("utf-8")

    def entry_at(self, i: int) -> TensorEntry:
        s = int(self._dim_ends[i - 1]) if i else 0
        shape = tuple(int(d) for d in self._dims[s : int(self._dim_ends[i])])
        dt = dtype_from_safetensors(_ST_NAMES[int(self._codes[i])])
        assert dt is not None
        begin, end = int(self.begin[i]), int(self.end[i])
        return TensorEntry(self.name_at(i), dt, shape, self._file.data_start + begin, end - begin, self._file)

    def index(self, name: str) -> int:
        """The tensor's position in the header, -1 when there is none of that name."""
        h = hash(name)
        k = int(np.searchsorted(self._sorted, h))
        while k < len(self._sorted) and self._sorted[k] == h:
            i = int(self._order[k])
            if self.name_at(i) == name:
                return i
            k += 1
        return -1

    def duplicate(self) -> int:
        """A position whose name appears earlier in the header too, or -1."""
        same = np.nonzero(self._sorted[1:] == self._sorted[:-1])[0]
        for k in same.tolist():  # equal hashes: equal names, or (rarely) a collision
            h, k0 = self._sorted[k + 1], k + 1
            while k0 > 0 and self._sorted[k0 - 1] == h:
                k0 -= 1
            mine = self.name_at(int(self._order[k + 1]))
            for j in range(k0, k + 1):
                if self.name_at(int(self._order[j])) == mine:
                    return int(max(self._order[j], self._order[k + 1]))
        return -1

    def __getitem__(self, name: str) -> TensorEntry:
        i = self.index(name) if isinstance(name, str) else -1
        if i < 0:
            raise KeyError(name)
        return self.entry_at(i)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.index(name) >= 0

    def __iter__(self) -> Iterator[str]:
        """The names in header order, decoded a block at a time (a million in about 0.3 s,
        with no list of a million offsets held)."""
        blob, ends = self._blob, self._name_ends
        start = 0
        for k in range(0, len(ends), 65536):
            for end in ends[k : k + 65536].tolist():
                yield blob[start:end].decode("utf-8")
                start = end


class _Builder:
    """The growing arrays of one header's entries (array.array: compact, cheap to append)."""

    def __init__(self) -> None:
        self.names = bytearray()
        self.name_ends = array.array("i")
        self.codes = array.array("B")
        self.dims = array.array("q")
        self.dim_ends = array.array("i")
        self.begin = array.array("q")
        self.end = array.array("q")
        self.hashes = array.array("q")

    def add(self, name: str, raw_name: bytes, code: int, shape: list[int], begin: int, end: int) -> None:
        self.names += raw_name
        self.name_ends.append(len(self.names))
        self.codes.append(code)
        self.dims.extend(shape)
        self.dim_ends.append(len(self.dims))
        self.begin.append(begin)
        self.end.append(end)
        self.hashes.append(hash(name))


@dataclass(eq=False)
class SafetensorsFile:
    """An open, validated safetensors file. Holds the descriptor that was validated, so the
    bytes read later come from the same file (not whatever the path names by then).
    ``entries`` is a read-only mapping, name -> TensorEntry, in header order."""

    path: str
    fd: int
    size: int
    data_start: int
    metadata: dict[str, str] | None
    entries: EntryTable | None = None  # set once validated

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fail(path: str, what: str, tensor: str | None = None) -> CheckpointError:
    where = describe_file(path) + (f", tensor '{shown(tensor)}'" if tensor is not None else ", header")
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
    """Untrusted JSON (an index) -> objects, every failure raised as ``fail(what)``:
    invalid UTF-8 or JSON, a repeated key (``on_duplicate(key)``), and what json itself
    refuses with ValueError/RecursionError (a 5000-digit integer, nesting past the stack)."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys(on_duplicate))
    except CheckpointError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"not valid UTF-8 JSON: {cut(str(e), 200)}") from None
    except (ValueError, RecursionError) as e:
        raise fail(f"cannot be parsed: {type(e).__name__}: {cut(str(e), 200)}") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_entry(path: str, name: str, info: Any, data_len: int, data_start: int) -> tuple[int, list[int], int, int]:
    """(dtype code, shape, begin, end) of one header entry, or a CheckpointError."""
    if not isinstance(info, dict):
        raise _fail(path, f"entry must be an object with dtype, shape and data_offsets, got {shown_value(info)}", name)
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise _fail(path, f"entry has no '{key}'", name)
    st = info["dtype"]
    if not isinstance(st, str):
        raise _fail(path, f"unknown dtype {shown_value(st)} (known: {', '.join(_ST_NAMES)})", name)
    shape = info["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _fail(path, f"shape must be a list of non-negative integers, got {shown_value(shape)}", name)
    offs = info["data_offsets"]
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
        raise _fail(path, f"data_offsets must be [begin, end] integers, got {shown_value(offs)}", name)
    begin, end = offs
    return _check_layout(path, name, st, shape, begin, end, data_len, data_start), shape, begin, end


def _check_layout(path: str, name: str, st: str, shape: list[int], begin: int, end: int, data_len: int,
                  data_start: int) -> int:
    """The checks of an entry whose fields have the right types (ints, a list of ints >= 0):
    dtype, dims, size against offsets, bounds. Returns the dtype code."""
    if not name:
        raise _fail(path, "a tensor has an empty name", name)
    code = _ST_CODE.get(st)
    if code is None:
        raise _fail(path, f"unknown dtype {shown_value(st)} (known: {', '.join(_ST_NAMES)})", name)
    if len(shape) > MAX_NDIM:
        raise _fail(path, f"shape has {len(shape)} dimensions; at most {MAX_NDIM} are supported", name)
    # Non-zero dims only: NumPy (and torch) refuse a shape whose non-zero dims overflow
    # int64, even when another dim is 0.
    span = math.prod(d for d in shape if d) * _ITEMSIZE[code]
    if span > _MAX_BYTES:
        raise _fail(path, f"shape {shown_value(shape)} of {st} is too large (more than 2^63 - 1 bytes)", name)
    if begin < 0 or end < begin:
        raise _fail(path, f"data_offsets {shown_value([begin, end])} are not 0 <= begin <= end", name)
    expected = 0 if 0 in shape else span
    if end - begin != expected:
        raise _fail(
            path,
            f"shape {shown_value(shape)} of {st} needs {expected} bytes but data_offsets "
            f"{shown_value([begin, end])} span {cut(str(end - begin), 40)}",
            name,
        )
    if end > data_len:
        raise _fail(
            path,
            f"data_offsets {shown_value([begin, end])} run past the end of the data section ({data_len} bytes from "
            f"byte {data_start}; the file is truncated or the offsets are wrong)",
            name,
        )
    return code


def _parse_metadata(path: str, meta: Any) -> dict[str, str] | None:
    if meta is None:
        return None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _fail(path, f"__metadata__ must map strings to strings, got {shown_value(meta)}")
    return meta


_WS = re.compile(r"[ \t\n\r]*")
# The usual entry, written as writers write it: a name without escapes, then dtype, shape and
# data_offsets in that order, integers of at most 19 digits. One regex match takes it; any
# other spelling (escapes, other key orders, extra keys, big numbers, errors) goes through
# json's scanner, which is the reference: this is only a faster way to the same result. At
# most MAX_NDIM dims: an unbounded repeat would hold a backtracking record per element of a
# hostile list (285 MiB for a 1 MiB window of "1,1,...") before failing.
_W = r"[ \t\n\r]*"
_N = r"(?:0|[1-9][0-9]{0,18})"
_FAST = re.compile(
    rf'{_W}"([^"\\\x00-\x1f]*)"{_W}:{_W}\{{{_W}"dtype"{_W}:{_W}"([A-Z0-9_]*)"{_W},{_W}'
    rf'"shape"{_W}:{_W}\[((?:{_W}{_N}{_W}(?:,{_W}{_N}{_W}){{0,{MAX_NDIM - 1}}})?){_W}\]{_W},{_W}'
    rf'"data_offsets"{_W}:{_W}\[{_W}({_N}){_W},{_W}({_N}){_W}\]{_W}\}}{_W}([,}}])'
)
# The same without whitespace, as the reference package writes it: three times as fast to
# match, so it is tried first.
_FAST_COMPACT = re.compile(_FAST.pattern.replace(_W, ""))
# How close to the end of the window an error must be to be possibly the window's doing:
# json reports a cut literal or number ("-Infinit", "\ud83d\ude0") up to 12 characters back.
_NEAR_END = 16


class _Reader:
    """The header's text a window at a time: at most one member (a name and its entry) plus
    a window is held, never the whole header (unless one entry is that large)."""

    def __init__(self, path: str, fd: int, hlen: int) -> None:
        self.path, self.fd = path, fd
        self.next, self.left = 8, hlen  # file offset and header bytes not read yet
        self.decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self.buf, self.pos = "", 0
        self.scan = json.scanner.make_scanner(
            json.JSONDecoder(object_pairs_hook=unique_keys(self._dup_in_entry))
        )

    def _dup_in_entry(self, key: str) -> CheckpointError:
        return _fail(self.path, f"the key '{shown(key)}' appears twice in one object")

    def more(self) -> bool:
        """Reads the next window (growing it for a member larger than one); False at the end."""
        if self.left == 0:
            return False
        n = min(self.left, max(_WINDOW_BYTES, len(self.buf) - self.pos))
        raw = os.pread(self.fd, n, self.next)
        if len(raw) != n:
            raise _fail(self.path, f"read {len(raw)} of {n} header bytes at byte {self.next} (the file shrank?)")
        try:
            text = self.decoder.decode(raw, final=n == self.left)
        except UnicodeDecodeError as e:
            where = self.next + e.start
            raise _fail(self.path, f"not valid UTF-8 JSON: bad UTF-8 at byte {where} of the file ({e.reason})") from None
        self.next += n
        self.left -= n
        self.buf = self.buf[self.pos :] + text
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is no JSON whitespace ('' at the end of the header)."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def expect(self, chars: str, what: str) -> str:
        c = self.peek()
        if not c or c not in chars:
            got = f"{c!r}" if c else "the end of the header"
            raise _fail(self.path, f"not valid UTF-8 JSON: expected {what}, got {got}")
        self.pos += 1
        return c

    def take(self, parse: Callable[[str, int], tuple[Any, int]], what: str, grow: bool = True) -> Any:
        """One JSON value parsed at the current position, reading more when the window cut
        it short. A value is complete only with _NEAR_END characters after it in the window
        (or at the end of the header): a number cut at the window's edge would parse. With
        ``grow=False`` a value the window cuts short is not read further: ``_CUT`` comes
        back, nothing consumed (the caller parses it piece by piece instead)."""
        while True:
            try:
                value, end = parse(self.buf, self.pos)
            except CheckpointError:
                raise
            except (json.JSONDecodeError, StopIteration) as e:
                at = e.pos if isinstance(e, json.JSONDecodeError) else (e.value if isinstance(e.value, int) else 0)
                cut_short = at >= len(self.buf) - _NEAR_END or str(e).startswith("Unterminated string")
                if cut_short and self.left and not grow:
                    return _CUT
                if cut_short and self.more():
                    continue
                detail = str(e) if isinstance(e, json.JSONDecodeError) else "expected a value"
                raise _fail(self.path, f"not valid UTF-8 JSON in {what}: {cut(detail, 200)}") from None
            except (ValueError, RecursionError) as e:  # a 5000-digit integer, nesting past the stack
                raise _fail(self.path, f"{what} cannot be parsed: {type(e).__name__}: {cut(str(e), 200)}") from None
            # A value ending near the window's end may have been cut ("2." of "2.5" parses as 2).
            if end >= len(self.buf) - _NEAR_END and self.left:
                if not grow:
                    return _CUT
                self.more()
                continue
            self.pos = end
            return value


_CUT = object()  # Reader.take(grow=False): the value runs past the window

# An entry larger than the window is parsed piece by piece (_Entry), never whole: a list
# longer than any valid one is refused at its first extra element, so a hostile entry (a
# "shape" of 30M integers) costs what a valid header of its size costs, not ten times more
# in Python objects. A valid entry holds at most 1 + (1 + MAX_NDIM) + 3 values; extra keys,
# which the reference ignores, share a budget well above that.
_ENTRY_VALUES = 4 * MAX_NDIM


class _Entry:
    """One entry's value parsed a token at a time from the reader, with json's own scanner
    for every scalar, accepting exactly what json accepts (a repeated key included: it is
    refused), while counting values: "shape" may hold MAX_NDIM, "data_offsets" 2, and the
    whole entry _ENTRY_VALUES."""

    def __init__(self, r: _Reader, name: str) -> None:
        self.r, self.name, self.left = r, name, _ENTRY_VALUES
        self.what = f"the entry of '{shown(name)}'"

    def _syntax(self, expected: str) -> CheckpointError:
        c = self.r.peek()
        got = f"{c!r}" if c else "the end of the header"
        return _fail(self.r.path, f"not valid UTF-8 JSON in {self.what}: expected {expected}, got {got}")

    def value(self, key: str | None = None) -> Any:
        """The value at the reader's position; key: the entry's key it belongs to (top level)."""
        self.left -= 1
        if self.left < 0:
            raise _fail(self.r.path, f"the entry holds more than {_ENTRY_VALUES} values (a tensor's entry has at "
                        f"most {MAX_NDIM + 6}: itself, dtype, shape and data_offsets)", self.name)
        c = self.r.peek()
        if c == "[":
            return self._list({"shape": MAX_NDIM, "data_offsets": 2}.get(key or ""), key)
        if c == "{":
            return self._object()
        if not c:
            raise self._syntax("a value")
        return self.r.take(self.r.scan, self.what)

    def _list(self, most: int | None, key: str | None) -> list[Any]:
        r = self.r
        r.pos += 1
        items: list[Any] = []
        if r.peek() == "]":
            r.pos += 1
            return items
        while True:
            if most is not None and len(items) == most:
                if key == "shape":
                    raise _fail(r.path, f"shape has more than {MAX_NDIM} dimensions; at most {MAX_NDIM} are "
                                "supported", self.name)
                raise _fail(r.path, "data_offsets must be [begin, end] integers, got a list of more than 2",
                            self.name)
            items.append(self.value())
            c = r.peek()
            if not c or c not in ",]":
                raise self._syntax("',' or ']'")
            r.pos += 1
            if c == "]":
                return items

    def _object(self, top: bool = False) -> dict[str, Any]:
        r = self.r
        r.pos += 1
        pairs: dict[str, Any] = {}
        if r.peek() == "}":
            r.pos += 1
            return pairs
        while True:
            if r.peek() != '"':
                raise self._syntax("a key in double quotes")
            key = r.take(_scan_string, self.what)
            if key in pairs:
                raise r._dup_in_entry(key)
            if r.peek() != ":":
                raise self._syntax("':'")
            r.pos += 1
            pairs[key] = self.value(key if top else None)
            c = r.peek()
            if not c or c not in ",}":
                raise self._syntax("',' or '}'")
            r.pos += 1
            if c == "}":
                return pairs

    def parse(self) -> Any:
        if self.r.peek() == "{":
            self.left -= 1
            return self._object(top=True)
        return self.value()


def _take_entry(r: _Reader, name: str) -> Any:
    """An entry's value: whole with json's scanner when it ends within the window (the
    usual case, and bounded by the window), else piece by piece (_Entry), bounded."""
    if name != "__metadata__":  # a map of strings: its size is the header's, as a valid one's
        value = r.take(r.scan, f"the entry of '{shown(name)}'", grow=False)
        if value is not _CUT:
            return value
        return _Entry(r, name).parse()
    return r.take(r.scan, f"the entry of '{shown(name)}'")


def _scan_string(s: str, i: int) -> tuple[str, int]:
    if i >= len(s):
        raise StopIteration(i)
    if s[i] != '"':
        raise json.JSONDecodeError("Expecting property name enclosed in double quotes", s, i)
    return json.decoder.scanstring(s, i + 1, True)


def _fast_members(r: _Reader, b: _Builder, path: str, data_len: int, data_start: int) -> bool:
    """Takes the usual entries (``_FAST``) at the reader's position, as many as match in a
    row; True when one ended the header's object. The loop is the per-tensor cost of a big
    header, so it is kept lean: the checks are those of ``_check_layout``, inline for the
    common case (one known dtype, sizes that match, in bounds) and by the call otherwise."""
    compact, match, buf, pos = _FAST_COMPACT.match, _FAST.match, r.buf, r.pos
    codes, sizes = _ST_CODE, _ITEMSIZE
    names, name_ends, dtypes, dims_out, dim_ends = b.names, b.name_ends, b.codes, b.dims, b.dim_ends
    begins, ends, hashes = b.begin, b.end, b.hashes
    try:
        while True:
            m = compact(buf, pos) or match(buf, pos)
            if m is None:
                return False
            name, st, dims, b0, e0, sep = m.groups()
            if name == "__metadata__":
                return False
            shape = [int(d) for d in dims.split(",")] if dims else []
            begin, end = int(b0), int(e0)
            code = codes.get(st)
            if code is None or not name or len(shape) > MAX_NDIM or end > data_len or end < begin:
                code = _check_layout(path, name, st, shape, begin, end, data_len, data_start)  # raises
            size = sizes[code]
            for d in shape:
                size *= d
            if end - begin != size or size > _MAX_BYTES or (not size and len(shape) > 1):  # 0-size: dims overflow?
                code = _check_layout(path, name, st, shape, begin, end, data_len, data_start)  # raises if bad
            names += name.encode("utf-8")
            name_ends.append(len(names))
            dtypes.append(code)
            dims_out.extend(shape)
            dim_ends.append(len(dims_out))
            begins.append(begin)
            ends.append(end)
            hashes.append(hash(name))
            pos = m.end()
            if sep == "}":
                return True
    finally:
        r.pos = pos


def _parse_header(path: str, fd: int, hlen: int, data_len: int, data_start: int) -> tuple[_Builder, Any]:
    """The header's entries, validated one by one as they are parsed; and its metadata."""
    r = _Reader(path, fd, hlen)
    b = _Builder()
    metadata: Any = None
    seen_metadata = False
    c = r.peek()
    if not c:
        raise _fail(path, "not valid UTF-8 JSON: the header is empty (or only whitespace)")
    if c != "{":
        raise _fail(path, f"the header must be a JSON object, it starts with {shown_value(c)}")
    r.pos += 1
    if r.peek() == "}":
        r.pos += 1
    else:
        while True:
            if _fast_members(r, b, path, data_len, data_start):
                break
            r.peek()
            name = r.take(_scan_string, "a tensor name")
            r.expect(":", "':' after a name")
            r.peek()
            info = _take_entry(r, name)
            if name == "__metadata__":
                if seen_metadata:
                    raise _fail(path, "the name appears more than once in the header", name)
                seen_metadata, metadata = True, info
            else:
                try:
                    raw_name = name.encode("utf-8")
                except UnicodeEncodeError:
                    raise _fail(path, "the name is not valid Unicode (an unpaired surrogate escape)",
                                name.encode("utf-8", "replace").decode()) from None
                code, shape, begin, end = _check_entry(path, name, info, data_len, data_start)
                b.add(name, raw_name, code, shape, begin, end)
            if r.expect(",}", "',' or '}' after an entry") == "}":
                break
    if r.peek():
        raise _fail(path, "not valid UTF-8 JSON: text after the header's closing brace")
    return b, metadata


def _check_ranges(path: str, t: EntryTable, data_len: int, strict: bool) -> None:
    """Strict (the reference package's rule): the tensors, ordered by (begin, end), tile the
    data section exactly: each begins where the previous ended, the first at 0, the last
    ends at the end of the file. Otherwise only: no two non-empty tensors overlap."""
    begin, end = t.begin, t.end
    if strict:
        order = np.lexsort((end, begin))
        b, e = begin[order], end[order]
        prev = np.concatenate((np.zeros(1, dtype=np.int64), e[:-1]))
        bad = np.nonzero(b != prev)[0]
        if len(bad):
            k = int(bad[0])
            before = f"tensor '{shown(t.name_at(int(order[k - 1])))}' ends" if k else "the data section begins"
            name = t.name_at(int(order[k]))
            if b[k] < prev[k]:
                raise _fail(path, f"its bytes [{b[k]}, {e[k]}) overlap those of {before} at {prev[k]}", name)
            raise _fail(path, f"its bytes [{b[k]}, {e[k]}) leave a gap of {int(b[k] - prev[k])} bytes after where "
                        f"{before} ({prev[k]}); strict mode, as the safetensors package (strict=False allows "
                        "gaps)", name)
        last = int(e[-1]) if len(e) else 0
        if last != data_len:
            raise _fail(path, f"{data_len - last} bytes after the last tensor's data (bytes {last} to {data_len} of "
                        "the data section belong to no tensor; strict mode, as the safetensors package; "
                        "strict=False allows them)")
        return
    full = np.nonzero(end > begin)[0]  # empty ranges hold nothing
    order = full[np.lexsort((end[full], begin[full]))]
    b, e = begin[order], end[order]
    bad = np.nonzero(b[1:] < e[:-1])[0]
    if len(bad):
        k = int(bad[0]) + 1
        raise _fail(path, f"its bytes [{b[k]}, {e[k]}) overlap those of tensor '{shown(t.name_at(int(order[k - 1])))}'",
                    t.name_at(int(order[k])))


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
        raise CheckpointError(f"checkpoint file '{shown(p)}' is {kind}, not a regular file: refused before opening "
                              "it (reading it could block forever or never end)")


def open_safetensors(path: str | os.PathLike[str], *, strict: bool = True) -> SafetensorsFile:
    """Open and validate one file: its header only, no tensor data is read.

    Raises :class:`CheckpointError` naming the file and the offending tensor for any
    malformed entry, or when it is no regular file (a FIFO, a device); OSError when the file
    cannot be opened. ``strict`` (the default) also applies the reference package's layout
    rule: the tensors' byte ranges tile the data section, no gaps, no trailing bytes.
    """
    p = os.fspath(path)
    require_regular_file(p)
    # O_NONBLOCK: should the path become a FIFO between the check and the open, the open
    # returns at once (and fstat refuses it); on a regular file it changes nothing.
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        require_regular_file(p, os.fstat(fd).st_mode)
        return _validate(p, fd, strict)
    except BaseException:
        os.close(fd)
        raise


def _validate(path: str, fd: int, strict: bool) -> SafetensorsFile:
    size = os.fstat(fd).st_size
    if size < 8:
        raise _fail(path, f"the file is {size} bytes, too short for the 8-byte header length (truncated?)")
    (hlen,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if hlen > MAX_HEADER_BYTES:
        raise _fail(path, f"header length {hlen} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt file?)")
    if 8 + hlen > size:
        raise _fail(path, f"header length {hlen} runs past the end of the {size}-byte file (truncated?)")
    data_start = 8 + hlen
    data_len = size - data_start
    builder, meta = _parse_header(path, fd, hlen, data_len, data_start)
    f = SafetensorsFile(path=path, fd=fd, size=size, data_start=data_start, metadata=_parse_metadata(path, meta))
    table = EntryTable(f, builder)
    del builder
    dup = table.duplicate()
    if dup >= 0:
        raise _fail(path, "the name appears more than once in the header", table.name_at(dup))
    _check_ranges(path, table, data_len, strict)
    f.entries = table
    return f
