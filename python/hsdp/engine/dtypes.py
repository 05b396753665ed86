"""Dtype names hsdp understands, as one small object usable everywhere.

A :class:`DType` is a ``str`` subclass holding the canonical name (``"bfloat16"``), so it
compares equal to the plain strings the C core returns and needs no conversion at the
boundary. It also knows its item size and the NumPy dtype values of it are *computed* in:
NumPy has no bfloat16 or float8 arithmetic, so those are held widened to float32 while
unsharded (the shard and the wire stay narrow; see docs/design.md).

The table is the core's (``_C.dtype_table()``: names, sizes, which are floats, and the
NumPy compute dtype from the wrapper's NumPy bridge); only the aliases are written here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _C


class DType(str):
    """A dtype by canonical name, with its size and compute dtype."""

    itemsize: int
    is_floating_point: bool
    compute: np.dtype

    def __new__(cls, name: str, itemsize: int, floating: bool, compute: str) -> "DType":
        obj = super().__new__(cls, name)
        obj.itemsize = itemsize
        obj.is_floating_point = floating
        obj.compute = np.dtype(compute)
        return obj

    @property
    def name(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"hsdp.{self.name}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (as_dtype, (self.name,))


ALL: tuple[DType, ...] = tuple(DType(*row) for row in _C.dtype_table())
_BY_NAME: dict[str, DType] = {d.name: d for d in ALL}

float32 = _BY_NAME["float32"]
float16 = _BY_NAME["float16"]
bfloat16 = _BY_NAME["bfloat16"]
float8_e4m3fn = _BY_NAME["float8_e4m3fn"]
float8_e5m2 = _BY_NAME["float8_e5m2"]
float64 = _BY_NAME["float64"]
bool_ = _BY_NAME["bool"]
uint8 = _BY_NAME["uint8"]
int8 = _BY_NAME["int8"]
uint16 = _BY_NAME["uint16"]
int16 = _BY_NAME["int16"]
uint32 = _BY_NAME["uint32"]
int32 = _BY_NAME["int32"]
uint64 = _BY_NAME["uint64"]
int64 = _BY_NAME["int64"]

_ALIASES: dict[str, DType] = {
    "fp32": float32, "float": float32, "f32": float32,
    "fp16": float16, "half": float16, "f16": float16,
    "bf16": bfloat16,
    "fp8": float8_e4m3fn, "float8_e4m3": float8_e4m3fn, "f8_e4m3": float8_e4m3fn,
    "f8_e5m2": float8_e5m2,
    "fp64": float64, "double": float64, "f64": float64,
    "bool_": bool_,
}


def as_dtype(value: Any) -> DType:
    """Return the :class:`DType` for a name, NumPy dtype, torch dtype or DType.

    Raises ``TypeError`` naming the value when it is not a dtype hsdp knows.
    """
    if isinstance(value, DType):
        return value
    name: str | None = None
    if isinstance(value, str):
        name = value
    elif isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        name = np.dtype(value).name
    elif type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        name = str(value)  # "torch.bfloat16"; torch itself is never imported here
    if name is not None:
        key = name[6:] if name.startswith("torch.") else name
        found = _BY_NAME.get(key) or _ALIASES.get(key.lower())
        if found is not None:
            return found
    raise TypeError(
        f"{value!r} is not a dtype hsdp knows; use one of {', '.join(_BY_NAME)} "
        "(names, NumPy dtypes and torch dtypes are accepted)"
    )


def from_numpy(dtype: np.dtype) -> DType:
    """The DType of a NumPy array's dtype (float32 arrays stay float32)."""
    return as_dtype(np.dtype(dtype))


def optional_float_dtype(value: Any, what: str) -> DType | None:
    """None, or the floating :class:`DType` ``value`` names: the one rule for a precision dtype
    (``param_dtype``, ``reduce_dtype``, ``output_dtype``, ``wire_dtype``), for
    MixedPrecisionPolicy and HSDPInferenceConfig (whose C constructor calls this). ``what``
    names the parameter: a TypeError for what is no dtype, a ValueError for one that is not
    floating."""
    if value is None:
        return None
    try:
        d = as_dtype(value)
    except TypeError as exc:
        raise TypeError(f"{what}: {exc}") from None
    if not d.is_floating_point:
        raise ValueError(f"{what} must be a floating-point dtype or None, got {d.name}")
    return d
