"""Writing safetensors files (and multi-file checkpoints with an index) that the reader's
rules accept. Tensors are encoded one at a time, so writing holds at most one tensor's bytes
beyond what the caller already holds; a file appears under its name only once complete."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import _C
from ..engine.dtypes import DType, as_dtype, from_numpy
from .format import MAX_HEADER_BYTES, dtype_to_safetensors

TensorLike = Any  # np.ndarray | Parameter | tuple[array, dtype]


@dataclass(frozen=True)
class _Item:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    encode: Callable[[], np.ndarray]  # raw little-endian bytes, made when written

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def _encoder(values: np.ndarray, dtype: DType, name: str) -> Callable[[], np.ndarray]:
    def encode() -> np.ndarray:
        if dtype.is_floating_point:
            if values.dtype.kind not in "biuf":
                raise TypeError(f"tensor '{name}': cannot write {values.dtype} values as {dtype.name}")
            if dtype.compute.name != dtype.name:  # bfloat16 / float8: the C core rounds
                # float64 as it is: through float32 first would round twice
                src = np.float64 if values.dtype == np.float64 else np.float32
                return _C.encode(np.asarray(values, dtype=src, order="C"), dtype.name)
        elif values.dtype.kind not in ("b" if dtype.name == "bool" else "iu"):
            raise TypeError(f"tensor '{name}': cannot write {values.dtype} values as {dtype.name}")
        elif dtype.name != "bool" and values.size:
            info = np.iinfo(dtype.compute)  # NumPy's cast would wrap out-of-range integers silently
            lo, hi = int(values.min()), int(values.max())
            if lo < info.min or hi > info.max:
                raise ValueError(f"tensor '{name}': values in [{lo}, {hi}] do not fit {dtype.name} "
                                 f"([{info.min}, {info.max}])")
        # asarray, not ascontiguousarray: the latter turns 0-dim into 1-dim.
        return np.asarray(values, dtype=dtype.compute.newbyteorder("<"), order="C")

    return encode


def _item(name: Any, value: TensorLike) -> _Item:
    from ..nn.parameter import Parameter  # lazy: keeps this module free of the runtime

    if not isinstance(name, str) or not name or name == "__metadata__":
        raise ValueError(f"tensor names must be non-empty strings other than '__metadata__', got {name!r}")
    try:
        if isinstance(value, Parameter):
            values, dtype = value.data, value.dtype  # logical dtype: a bfloat16 parameter writes BF16
        elif isinstance(value, tuple) and len(value) == 2:
            values, dtype = np.asarray(value[0]), as_dtype(value[1])
        else:
            values, dtype = None, None
    except (RuntimeError, TypeError) as exc:  # a meta or sharded parameter, an unknown dtype
        raise type(exc)(f"tensor '{name}': {exc}") from None
    if values is None:
        values = np.asarray(value)
        try:
            dtype = from_numpy(values.dtype)
        except TypeError:
            raise TypeError(f"tensor '{name}': NumPy dtype {values.dtype} has no safetensors equivalent") from None
    return _Item(name, dtype, tuple(int(d) for d in values.shape), _encoder(values, dtype, name))


def _items(tensors: Mapping[str, TensorLike] | Any) -> list[_Item]:
    if hasattr(tensors, "named_parameters") and not isinstance(tensors, Mapping):
        pairs: Iterable[tuple[str, Any]] = tensors.named_parameters()
    else:
        pairs = tensors.items()
    return [_item(n, v) for n, v in pairs]


def _header(items: list[_Item], metadata: Mapping[str, str] | None) -> bytes:
    head: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("metadata must map strings to strings")
        head["__metadata__"] = dict(metadata)
    off = 0
    for it in items:
        st = dtype_to_safetensors(it.dtype)
        head[it.name] = {"dtype": st, "shape": list(it.shape), "data_offsets": [off, off + it.nbytes]}
        off += it.nbytes
    raw = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-aligned, as the reference writes it
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"the header would be {len(raw)} bytes, over the {MAX_HEADER_BYTES}-byte limit readers accept")
    return raw


def _write_file(items: list[_Item], path: Path, metadata: Mapping[str, str] | None) -> None:
    header = _header(items, metadata)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            for it in items:
                raw = it.encode()
                if raw.shape != it.shape:
                    raise ValueError(f"tensor '{it.name}': encoded shape {raw.shape} != {it.shape}")
                f.write(memoryview(raw.reshape(-1)).cast("B"))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pack(items: list[_Item], limit: int) -> list[list[_Item]]:
    """Greedy, in order: a new file when the next tensor would pass the limit."""
    groups: list[list[_Item]] = [[]]
    size = 0
    for it in items:
        if groups[-1] and size + it.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(it)
        size += it.nbytes
    return groups


def save_checkpoint(
    tensors: Mapping[str, TensorLike] | Any,
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    *,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Write ``tensors`` as safetensors; returns the paths written.

    ``tensors`` maps names to NumPy arrays (their dtype is written), ``(values, dtype)``
    pairs (values rounded to ``dtype``, e.g. ``"bfloat16"``), or :class:`hsdp.nn.Parameter`
    (its logical dtype); a module writes its ``named_parameters()``. With
    ``max_shard_bytes``, ``path`` must end in ``.index.json``: the tensors go to
    ``<stem>-00001-of-0000N.safetensors`` files of at most that many bytes (a larger tensor
    gets a file of its own) next to it, and the index maps each name to its file. Missing
    parent folders are created.
    """
    if sys.byteorder != "little":
        raise NotImplementedError("writing safetensors on a big-endian machine is not supported")
    items = _items(tensors)
    p = Path(os.fspath(path))
    p.parent.mkdir(parents=True, exist_ok=True)  # like the files it writes, its folder is ours to make
    if max_shard_bytes is None:
        _write_file(items, p, metadata)
        return [p]
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if not p.name.endswith(".index.json"):
        raise ValueError(f"with max_shard_bytes, path must name the index (*.index.json), got '{p}'")
    stem = p.name[: -len(".index.json")].removesuffix(".safetensors")
    groups = _pack(items, max_shard_bytes)
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, 1):
        fp = p.with_name(f"{stem}-{i:05d}-of-{len(groups):05d}.safetensors")
        _write_file(group, fp, metadata)
        written.append(fp)
        weight_map.update((it.name, fp.name) for it in group)
    index = {"metadata": {**(metadata or {}), "total_size": sum(it.nbytes for it in items)}, "weight_map": weight_map}
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, p)
    return [*written, p]
