"""MixedPrecisionPolicy: which dtype shards are stored and gathered in.

Inference has no master weights, so ``param_dtype`` is applied once, when a parameter is
sharded: the shard and the wire are in ``param_dtype``. What a parameter is then computed
in is the framework's choice, asked of its adapter (``TensorAdapter.compute_dtype``): NumPy
has no bfloat16 or float8, so the NumPy adapter computes those in float32 (converted in C
while unsharding); torch computes in them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .dtypes import DType, as_dtype


def _opt(value: Any, what: str) -> DType | None:
    if value is None:
        return None
    d = as_dtype(value)
    if not d.is_floating_point:
        raise ValueError(f"{what} must be a floating-point dtype or None, got {d.name}")
    return d


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, name, _opt(getattr(self, name), name))

    @property
    def input_dtype(self) -> DType | None:
        """The dtype floating forward inputs are cast to (the adapter casts them to what it
        computes that dtype in), or None for no cast."""
        if not self.cast_forward_inputs or self.param_dtype is None:
            return None
        return self.param_dtype
