"""``Parameter``: a named weight whose storage the sharding engine can swap underneath it.

The contract with the C engine (docs/design.md, "Read-only views and parameter identity"): the
Parameter object a user holds never changes. While unsharded the engine sets ``_data``
directly to a read-only view into the unit's gathered buffer; while sharded it sets ``_data`` to None and ``_hsdp_state`` to a short
description. Every read goes through :attr:`Parameter.data`, so a sharded parameter used
outside its unit fails loudly instead of computing with stale numbers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..engine.dtypes import DType, as_dtype, float32, from_numpy
from .init import is_meta_init


class Parameter:
    """A weight: shape, logical dtype and (unless meta or sharded) a NumPy array of values.

    Values are held in the dtype's compute dtype (``DType.compute``): bfloat16 and float8 are
    held as float32 arrays whose values are rounded to the logical dtype; ``nbytes`` reports
    the logical (storage) size.
    """

    # Fixed slots: the C engine reads and writes ``_data`` and ``_hsdp_state`` by name, and a
    # model can hold many thousands of parameters. Identity hash (no __eq__) so parameters can
    # key dicts and sets the way torch parameters do.
    __slots__ = ("_data", "_dtype", "_shape", "requires_grad", "_hsdp_state", "__weakref__")

    _data: np.ndarray | None
    _dtype: DType
    _shape: tuple[int, ...]
    requires_grad: bool
    _hsdp_state: str | None

    def __init__(
        self,
        data: Any = None,
        dtype: Any = None,
        requires_grad: bool = True,
        *,
        shape: Any = None,
    ) -> None:
        self._data = None
        self._hsdp_state = None
        self.requires_grad = bool(requires_grad)
        if data is None:
            if shape is None:
                raise ValueError("a Parameter without data needs shape= (it is then a meta parameter)")
            self._shape = _as_shape(shape)
            self._dtype = float32 if dtype is None else as_dtype(dtype)
            return
        if isinstance(data, Parameter):
            data = data.data
        arr = np.asarray(data)
        self._dtype = from_numpy(arr.dtype) if dtype is None else as_dtype(dtype)
        self._shape = tuple(int(s) for s in arr.shape)
        if shape is not None and _as_shape(shape) != self._shape:
            raise ValueError(f"shape={_as_shape(shape)} does not match the data's shape {self._shape}")
        if is_meta_init():
            return  # keep only shape and dtype: no weight memory under meta_init
        self._data = self._convert(arr)

    @classmethod
    def _filled(cls, shape: Any, dtype: Any, value: float, requires_grad: bool = True) -> "Parameter":
        """A parameter filled with ``value`` (0 or 1: exact in every dtype), meta under meta_init.

        Layers use this so building a bfloat16 model needs no rounding (and no C extension).
        """
        dt = as_dtype(dtype)
        p = cls(None, dt, requires_grad, shape=shape)
        if not is_meta_init():
            p._data = np.full(p._shape, value, dtype=dt.compute)
        return p

    # -- data -----------------------------------------------------------------------------

    @property
    def data(self) -> np.ndarray:
        """The full value; raises RuntimeError while meta or sharded."""
        d = self._data
        if d is not None:
            return d
        raise self._no_data_error()

    @data.setter
    def data(self, value: Any) -> None:
        if self._hsdp_state is not None:
            raise RuntimeError(
                f"cannot assign to a parameter of shape {self._shape} and dtype {self._dtype.name} "
                f"that is {self._hsdp_state}; load weights through hsdp's loader or under "
                "hsdp.unshard(module)"
            )
        if isinstance(value, Parameter):
            value = value.data
        self._data = self._convert(np.asarray(value))

    def _no_data_error(self) -> RuntimeError:
        if self._hsdp_state is not None:
            return RuntimeError(
                f"parameter of shape {self._shape} and dtype {self._dtype.name} is {self._hsdp_state}; "
                "its full value exists only inside that unit's forward or under hsdp.unshard(module)"
            )
        return RuntimeError(
            f"parameter of shape {self._shape} and dtype {self._dtype.name} was built under "
            "hsdp.nn.meta_init() and has no data yet; load weights first"
        )

    def _convert(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` as a C-contiguous array in this parameter's compute dtype, rounded as needed.

        np.asarray(order="C"), not np.ascontiguousarray: the latter turns 0-dim into 1-dim.
        """
        if arr.shape != self._shape:
            raise ValueError(
                f"cannot assign an array of shape {tuple(arr.shape)} to a parameter of shape {self._shape}"
            )
        dt = self._dtype
        kind = arr.dtype.kind
        if dt.is_floating_point:
            if kind not in "biuf":
                raise TypeError(f"cannot assign {arr.dtype} data to a {dt.name} parameter")
            if dt.compute.name != dt.name:
                # bfloat16 / float8: NumPy cannot round to these, the C core can (ties to even).
                from hsdp import _C  # lazy: importing hsdp.nn must not need the extension

                # float64 goes to C as it is: rounding through float32 first would round twice.
                src = np.float64 if arr.dtype == np.float64 else np.float32
                rounded = _C.round_to(np.asarray(arr, dtype=src, order="C"), dt.name)
                return rounded.reshape(self._shape)
            # float16/32/64: NumPy's cast rounds to nearest even.
            return np.asarray(arr, dtype=dt.compute, order="C")
        if dt.name == "bool":
            if kind != "b":
                raise TypeError(f"cannot assign {arr.dtype} data to a bool parameter")
            return np.asarray(arr, dtype=np.bool_, order="C")
        if kind not in "iu":
            raise TypeError(
                f"cannot assign {arr.dtype} data to a {dt.name} parameter; "
                "convert it to integers explicitly (e.g. quantize) first"
            )
        if arr.size:
            info = np.iinfo(dt.compute)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise ValueError(
                    f"values in [{lo}, {hi}] do not fit a {dt.name} parameter ([{info.min}, {info.max}])"
                )
        return np.asarray(arr, dtype=dt.compute, order="C")

    def _set_dtype(self, dtype: Any) -> None:
        """Change the logical dtype, converting the values (used by ``Module.to(dtype=...)``)."""
        new = as_dtype(dtype)
        if self._hsdp_state is not None:
            raise RuntimeError(
                f"cannot change the dtype of a parameter of shape {self._shape} that is {self._hsdp_state}"
            )
        old_dtype, old = self._dtype, self._data
        self._dtype = new
        if old is None:
            return
        try:
            self._data = self._convert(old)
        except BaseException:
            self._dtype = old_dtype
            raise

    # -- metadata -------------------------------------------------------------------------

    @property
    def dtype(self) -> DType:
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def nbytes(self) -> int:
        """Logical (storage) bytes: numel * dtype.itemsize, whatever the compute array holds."""
        return self.numel() * self._dtype.itemsize

    @property
    def is_meta(self) -> bool:
        """No data and not sharded: built under meta_init and not loaded yet."""
        return self._data is None and self._hsdp_state is None

    def numel(self) -> int:
        return math.prod(self._shape)

    def is_floating_point(self) -> bool:
        return self._dtype.is_floating_point

    def requires_grad_(self, requires_grad: bool = True) -> "Parameter":
        self.requires_grad = bool(requires_grad)
        return self

    def __repr__(self) -> str:
        # Reads only metadata: repr of a sharded parameter must never touch data.
        if self._hsdp_state is not None and self._data is None:
            extra = ", sharded"
        elif self._data is None:
            extra = ", meta"
        else:
            extra = ""
        rg = "" if self.requires_grad else ", requires_grad=False"
        return f"Parameter(shape={self._shape}, dtype={self._dtype.name}{extra}{rg})"


def _as_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    out = tuple(int(s) for s in shape)
    if any(s < 0 for s in out):
        raise ValueError(f"shape {out} has a negative dimension")
    return out


__all__ = ["Parameter"]
