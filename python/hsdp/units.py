"""A sharded module's unit: the C unit that holds its flat shard, and the forward hooks.

The hot path is two C calls per unit per forward (``Unit.unshard`` and ``Unit.reshard``);
they set every parameter's ``_data`` themselves, so there is no per-parameter Python loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import _C
from .dtypes import DType
from .policy import MixedPrecisionPolicy


def _cast_tree(obj: Any, dtype: np.dtype) -> Any:
    """Casts floating NumPy arrays in (nested) tuples, lists and dicts to dtype."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind == "f" and obj.dtype != dtype:
            return obj.astype(dtype)
        return obj
    if isinstance(obj, tuple):
        return tuple(_cast_tree(x, dtype) for x in obj)
    if isinstance(obj, list):
        return [_cast_tree(x, dtype) for x in obj]
    if isinstance(obj, dict):
        return {k: _cast_tree(v, dtype) for k, v in obj.items()}
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
        self._output_dtype = policy.output_dtype.compute if (is_root and policy.output_dtype) else None
        # True while the unit is unsharded because a forward pre-hook did it (so the
        # post-hook may reshard); an explicit hsdp.unshard() stays until hsdp.reshard().
        self._hook_unsharded = False
        self._handles: list[Any] = []
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
        if not self.unit.is_unsharded:
            self.unit.unshard()
            self._hook_unsharded = True
        if self._input_dtype is not None:
            return _cast_tree(args, self._input_dtype), _cast_tree(kwargs, self._input_dtype)
        return None

    def _post_forward(self, module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        if self._hook_unsharded and self.reshard_after_forward:
            self.unit.reshard()
            self._hook_unsharded = False
        if self._output_dtype is not None:
            return _cast_tree(output, self._output_dtype)
        return None

    def unshard(self) -> None:
        self._check()
        self.unit.unshard()

    def reshard(self) -> None:
        self.unit.reshard()
        self._hook_unsharded = False

    def __repr__(self) -> str:
        return f"UnitState({self.label!r}, params={len(self.params)}, {self.unit!r})"


ShardCondition = Callable[[str, Any], bool]
