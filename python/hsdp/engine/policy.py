"""MixedPrecisionPolicy, and the storage-dtype policy: which dtype shards are stored and
gathered in.

Inference has no master weights, so ``param_dtype`` is applied once, when a parameter is
sharded: the shard and the wire are in ``param_dtype``. What a parameter is then computed
in is the framework's choice, asked of its adapter (``TensorAdapter.compute_dtype``): NumPy
has no bfloat16 or float8, so the NumPy adapter computes those in float32 (converted in C
while unsharding); torch computes in them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .dtypes import DType, float8_e4m3fn, float8_e5m2, float32, optional_float_dtype

if TYPE_CHECKING:
    from .port import TensorAdapter

FP8 = (float8_e4m3fn, float8_e5m2)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):  # the one rule (HSDPInferenceConfig's too)
            object.__setattr__(self, name, optional_float_dtype(getattr(self, name), name))

    @property
    def input_dtype(self) -> DType | None:
        """The dtype floating forward inputs are cast to (the adapter casts them to what it
        computes that dtype in), or None for no cast."""
        if not self.cast_forward_inputs or self.param_dtype is None:
            return None
        return self.param_dtype


def model_param_dtype(ad: TensorAdapter, model: Any, param_dtype: Any) -> Any:
    """param_dtype, or None when the model keeps every parameter's own dtype (it holds FP8
    parameters, or sets _hsdp_preserve_parameter_dtypes)."""
    has_fp8 = any(ad.dtype(p) in FP8 for _, p in ad.named_parameters(model))
    preserve = bool(getattr(model, "_hsdp_preserve_parameter_dtypes", False))
    return None if (has_fp8 or preserve) else param_dtype


def keep_modules(model: Any) -> frozenset[str]:
    """The names in diffusers' ``_keep_in_fp32_modules`` of ``model`` (a str or a list)."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    return frozenset([keep] if isinstance(keep, str) else keep)


def kept(keep: frozenset[str], name: str) -> bool:
    """Whether parameter `name` lies under one of the _keep_in_fp32_modules."""
    return bool(keep) and not keep.isdisjoint(name.split("."))


def storage_dtype(ad: TensorAdapter, p: Any, policy: MixedPrecisionPolicy, keep: bool) -> DType:
    """The dtype parameter ``p`` is stored (and gathered) in: ``policy.param_dtype``, except
    float8 parameters (their own), and float32 for a kept one (``keep``: under a
    ``_keep_in_fp32_modules`` name) when ``param_dtype`` is narrower."""
    pd = policy.param_dtype
    if pd is None or ad.dtype(p) in FP8:
        return ad.dtype(p)
    if keep and pd.itemsize < float32.itemsize:
        return float32  # as diffusers loads them: float32 whatever the rest is stored in
    return pd


def unit_input_dtype(policy: MixedPrecisionPolicy, storage: Sequence[DType]) -> DType | None:
    """What a unit casts its floating inputs to: the policy's input dtype, except for a unit
    all of whose parameters are kept in another dtype (diffusers' _keep_in_fp32_modules under
    a narrower param_dtype). Such a module computes in its own dtype and is written to take
    its inputs as they come (diffusers casts nothing for it: Wan casts the timestep to its
    time_embedder's dtype itself), so a cast to param_dtype would only feed bfloat16 to
    float32 weights. It casts nothing."""
    dt = policy.input_dtype
    if dt is None or not storage or policy.param_dtype in storage:
        return dt
    return None
