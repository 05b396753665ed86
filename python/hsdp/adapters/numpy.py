"""The NumPy adapter: hsdp's own PyTorch-like runtime (``hsdp.nn``) on NumPy arrays.

NumPy has no bfloat16 or float8 arithmetic, so parameters stored in those dtypes are
computed in float32: the C unit converts them while unsharding (the shard and the wire stay
narrow). The C unit binds views itself (``bind_attr = "_data"``); :meth:`NumpyAdapter.bind`
is the same binding in Python, for adapters built on this one that bind themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _C
from ..engine.dtypes import DType, as_dtype

if TYPE_CHECKING:
    from ..engine.units import UnitState


def _cast_tree(obj: Any, dtype: np.dtype, round_to: str | None = None) -> Any:
    """Casts floating arrays in (nested) tuples, lists and dicts to dtype; with round_to
    (bfloat16, float8), values are first rounded to that dtype."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind != "f":
            return obj
        if round_to is not None:
            return _C.round_to(np.ascontiguousarray(obj, dtype=np.float32), round_to)
        return obj.astype(dtype) if obj.dtype != dtype else obj
    if isinstance(obj, tuple):
        return tuple(_cast_tree(x, dtype, round_to) for x in obj)
    if isinstance(obj, list):
        return [_cast_tree(x, dtype, round_to) for x in obj]
    if isinstance(obj, dict):
        return {k: _cast_tree(v, dtype, round_to) for k, v in obj.items()}
    return obj


class NumpyAdapter:
    """:class:`~hsdp.engine.port.TensorAdapter` for ``hsdp.nn`` modules."""

    name = "numpy"
    bind_attr: str | None = "_data"  # the C unit sets Parameter._data to each view

    # -- modules ---------------------------------------------------------------------------
    def owns(self, module: Any) -> bool:
        from ..nn import Module

        return isinstance(module, Module)

    def named_parameters(self, module: Any, remove_duplicate: bool = True) -> Iterator[tuple[str, Any]]:
        return module.named_parameters(remove_duplicate=remove_duplicate)

    def has_forward(self, module: Any) -> bool:
        from ..nn import Module

        return type(module).forward is not Module.forward  # ModuleList has none

    def named_buffers(self, module: Any) -> list[tuple[str, Any]]:
        return []  # hsdp.nn modules hold parameters only

    def add_hooks(self, module: Any, pre: Callable[..., Any], post: Callable[..., Any]) -> list[Any]:
        return [
            module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True, always_call=True),
        ]

    def move(self, module: Any, device: Any) -> None:
        module.to(device)

    def place_whole(self, model: Any, params: Iterable[Any], device: Any) -> None:
        pass  # one device: the CPU

    def freeze(self, module: Any) -> None:
        for p in module.parameters():
            p.requires_grad = False

    def copy_state_dict(self, module: Any) -> dict[str, Any]:
        return {k: np.array(v, copy=True) for k, v in module.state_dict().items()}

    # -- parameters ------------------------------------------------------------------------
    def dtype(self, p: Any) -> DType:
        return p.dtype

    def shape(self, p: Any) -> tuple[int, ...]:
        return tuple(p.shape)

    def is_shardable(self, p: Any) -> bool:
        return p.ndim > 0 and p.is_floating_point()

    def is_sharded(self, p: Any) -> bool:
        return getattr(p, "_hsdp_state", None) is not None

    def shard_source(self, p: Any) -> tuple[Any, str | None] | None:
        # Values are held in the compute dtype; the unit casts them to the storage dtype.
        return None if p._data is None else (p._data, None)

    def values(self, p: Any) -> Any:
        return p._data

    def assign(self, p: Any, array: Any) -> None:
        p.data = array

    def restore(self, p: Any, saved: Any) -> None:
        p._data = saved

    def unloaded(self, module: Any) -> list[str]:
        return [n for n, p in module.named_parameters() if p._data is None and p._hsdp_state is None]

    def held_nbytes(self, params: Iterable[Any]) -> int:
        return sum(p.numel() * p.dtype.compute.itemsize for p in params)

    def mark_sharded(self, params: tuple[Any, ...], dtypes: tuple[DType, ...], state: str, device: str) -> None:
        for p, dt in zip(params, dtypes):
            p._data = None
            p._dtype = dt
            p._hsdp_state = state

    # -- dtypes and devices ----------------------------------------------------------------
    def compute_dtype(self, storage: DType) -> DType:
        return as_dtype(storage.compute)

    def check_device(self, target_device: Any) -> None:
        if target_device is not None and str(target_device) != "cpu":
            raise ValueError(
                f"target_device {target_device!r} is not available: this runtime computes on the CPU "
                "(NumPy); use 'cpu' or None"
            )

    def device_type(self, target_device: Any) -> str | None:
        return None  # NumPy views (bind_attr) need host memory

    # -- forwards --------------------------------------------------------------------------
    def cast_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: DType) -> tuple[Any, Any]:
        return _cast_tree(args, dtype.compute), _cast_tree(kwargs, dtype.compute)

    def cast_output(self, output: Any, dtype: DType) -> Any:
        # NumPy holds bfloat16/float8 outputs as float32 values rounded to that dtype
        narrow = dtype.name if dtype.compute.itemsize != dtype.itemsize else None
        return _cast_tree(output, dtype.compute, narrow)

    # -- binding in Python (the C unit does this itself while bind_attr is set) -------------
    # -- exchanges ---------------------------------------------------------------------------
    def permute(self, t: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        return t.transpose(axes)

    def to_float32(self, t: Any) -> np.ndarray:
        return np.ascontiguousarray(t, dtype=np.float32)

    def all_gather(self, group: Any, send: np.ndarray) -> np.ndarray:
        send = np.ascontiguousarray(send)
        recv = np.empty((group.size, *send.shape), dtype=send.dtype)
        group.all_gather(send, recv)
        return recv

    def all_to_all(self, group: Any, send: np.ndarray) -> np.ndarray:
        send = np.ascontiguousarray(send)
        recv = np.empty_like(send)
        group.all_to_all(send, recv)
        return recv

    def bind(self, state: UnitState) -> None:
        bufs = state.unit.buffers()
        for p, (which, offset), dt in zip(state.params, state.unit.view_specs, state.unit.compute_dtypes):
            shape = self.shape(p)
            compute = as_dtype(dt).compute
            if compute.name != dt:
                raise TypeError(f"parameter of unit '{state.label}' is computed in {dt}, which NumPy has no type for")
            view = np.frombuffer(bufs[which], dtype=compute, count=math.prod(shape), offset=offset)
            p._data = view.reshape(shape)

    def unbind(self, state: UnitState) -> None:
        for p in state.params:
            p._data = None
