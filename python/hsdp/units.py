"""A sharded module's unit: the C unit that holds its flat shard, and the forward hooks.

The hot path is two C calls per unit per forward (``Unit.unshard`` and ``Unit.reshard``);
they set every parameter's ``_data`` themselves, so there is no per-parameter Python loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import _C, trace
from .dtypes import DType
from .policy import MixedPrecisionPolicy
from .schedule import Schedule


def _cast_tree(obj: Any, dtype: np.dtype, round_to: str | None = None) -> Any:
    """Casts floating NumPy arrays in (nested) tuples, lists and dicts to dtype; with
    round_to (bfloat16, float8), values are first rounded to that dtype."""
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


class UnitState:
    """One sharded module: its parameters, its C unit and its hooks."""

    def __init__(
        self,
        module: Any,
        fqn: str,
        unit: _C.Unit,
        params: tuple[Any, ...],
        names: tuple[str, ...],
        storage_dtypes: tuple[DType, ...],
        reshard_after_forward: bool,
        policy: MixedPrecisionPolicy,
        is_root: bool,
    ) -> None:
        self.module = module
        self.fqn = fqn
        self.unit = unit
        self.params = params
        self.names = names
        self.storage_dtypes = storage_dtypes
        self.reshard_after_forward = reshard_after_forward
        self.policy = policy
        self.is_root = is_root
        self._input_dtype = policy.input_dtype
        out = policy.output_dtype if is_root else None
        self._output_dtype = out.compute if out is not None else None
        # NumPy holds bfloat16/float8 outputs as float32 values rounded to that dtype
        self._output_round = out.name if out is not None and out.compute.itemsize != out.itemsize else None
        # Set by an explicit hsdp.unshard() (or hsdp.resident): forwards then leave the
        # unit unsharded until hsdp.reshard().
        self._explicit = False
        self._handles: list[Any] = []
        self.schedule: Schedule | None = None  # shared by the units of one model
        self.full_bytes = unit.total_bytes + unit.widened_bytes
        self.buffer_sizes = tuple(n for n in (unit.total_bytes, unit.widened_bytes) if n)
        # Set when a load into this unit failed: the model must not run on partial weights.
        self.broken: str | None = None

    @property
    def label(self) -> str:
        return self.fqn or "<root>"

    def commit(self) -> None:
        """Switch the parameters to their sharded state and install the hooks."""
        state = f"sharded by hsdp in unit '{self.label}'"
        for p, dt in zip(self.params, self.storage_dtypes):
            p._data = None
            p._dtype = dt
            p._hsdp_state = state
        self._handles.append(self.module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self._handles.append(
            self.module.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)
        )
        object.__setattr__(self.module, "_hsdp_unit", self)

    def mark_broken(self, reason: str) -> None:
        """Makes every later use of this unit raise `reason` (a failed load, say)."""
        self.broken = reason
        self.unit.reshard()

    def _check(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"unit '{self.label}' is unusable: {self.broken}")

    def _pre_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.broken is not None:
            self._check()
        sched = self.schedule
        if sched is not None:
            if self.is_root:
                sched.begin()
            if sched.in_forward:
                sched.enter(self)  # records the order, or notices a departure from it
        if not self.unit.is_unsharded:
            if trace.enabled:
                trace.unshard(self)
            else:
                self.unit.unshard()  # waits for a prefetched gather, or gathers now
        if sched is not None and sched.in_forward:
            sched.prefetch()  # the next units gather while this one computes
        if trace.enabled:
            trace.compute_begin(self)
        if self._input_dtype is not None:
            return _cast_tree(args, self._input_dtype), _cast_tree(kwargs, self._input_dtype)
        return None

    def _post_forward(self, module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        if trace.enabled:
            trace.compute_end(self)
        sched = self.schedule
        if sched is not None and sched.in_forward:
            sched.leave(self)
        if self.reshard_after_forward and not self._explicit:
            self.unit.reshard()
        if sched is not None and self.is_root and sched.in_forward:
            sched.end()
        if self._output_dtype is not None:
            return _cast_tree(output, self._output_dtype, self._output_round)
        return None

    def prefetched_by_schedule(self) -> None:
        """The schedule started this unit's gather ahead of its forward."""
        if trace.enabled:
            trace.prefetch_started(self)

    def release_prefetch(self) -> None:
        """A prefetched unit the forward did not reach: give its buffers back."""
        if not self._explicit:
            self.unit.reshard()

    def unshard(self, async_op: bool = False) -> "UnitShardHandle | None":
        self._check()
        self._explicit = True
        if async_op:
            self.unit.start_unshard()
            return UnitShardHandle(self)
        self.unit.unshard()
        return None

    def reshard(self) -> None:
        self._explicit = False
        self.unit.reshard()

    def __repr__(self) -> str:
        return f"UnitState({self.label!r}, params={len(self.params)}, {self.unit!r})"


class UnitShardHandle:
    """Returned by ``hsdp.unshard(module, async_op=True)``: the gather runs on the collective
    worker; ``wait()`` blocks until it is done and the parameters are bound."""

    def __init__(self, *units: UnitState) -> None:
        self._units = units

    def wait(self) -> None:
        for u in self._units:
            u.unit.wait()

    def is_completed(self) -> bool:
        return not any(u.unit.is_pending for u in self._units)


ShardCondition = Callable[[str, Any], bool]
