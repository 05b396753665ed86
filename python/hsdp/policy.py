"""MixedPrecisionPolicy: which dtype shards are stored and gathered in.

Inference has no master weights, so ``param_dtype`` is applied once, when a parameter is
sharded: the shard and the wire are in ``param_dtype``. NumPy has no bfloat16 or float8, so
those are widened to float32 in C as part of unsharding; float16, float32 and float64
parameters are unsharded as views of their own dtype. (hsdp.nn's layers then compute in
float32, or float64 when both operands are float64.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

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
    def input_dtype(self) -> np.dtype | None:
        """The NumPy dtype floating forward inputs are cast to, or None for no cast."""
        if not self.cast_forward_inputs or self.param_dtype is None:
            return None
        return self.param_dtype.compute
