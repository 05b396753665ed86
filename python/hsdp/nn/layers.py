"""Layers: Linear, LayerNorm, RMSNorm and activations, on :mod:`hsdp.nn.functional`.

Parameters are created meta under ``meta_init()`` and otherwise as zeros/ones (exact in every
dtype); real values come from an init function or a checkpoint. Forwards read
``self.weight.data`` on every call and never cache it: while sharded, that array exists only
during the owning unit's forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..engine.dtypes import as_dtype, float32
from . import functional as F
from .module import Module
from .parameter import Parameter


def _dtype_repr(dtype: Any) -> str:
    return "" if dtype == float32 else f", dtype={as_dtype(dtype).name}"


class Linear(Module):
    """y = x @ weight.T + bias, weight of shape (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: Any = float32) -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.weight = Parameter._filled((self.out_features, self.in_features), dtype, 0.0)
        # Registered as None when absent, as torch does, so the name is still a parameter slot.
        self.register_parameter("bias", Parameter._filled((self.out_features,), dtype, 0.0) if bias else None)

    def forward(self, x: Any, out: F.Out = None) -> np.ndarray:
        b = self.bias
        return F.linear(x, self.weight.data, None if b is None else b.data, out=out)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}{_dtype_repr(self.weight.dtype)}"
        )


class LayerNorm(Module):
    """LayerNorm over the last axis; with elementwise_affine, weight (ones) and bias (zeros)."""

    def __init__(
        self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True, dtype: Any = float32
    ) -> None:
        super().__init__()
        self.dim = int(dim)
        self.eps = float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        if elementwise_affine:
            self.weight = Parameter._filled((self.dim,), dtype, 1.0)
            self.bias = Parameter._filled((self.dim,), dtype, 0.0)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: Any) -> np.ndarray:
        w, b = self.weight, self.bias
        return F.layer_norm(x, self.dim, None if w is None else w.data, None if b is None else b.data, self.eps)

    def extra_repr(self) -> str:
        return f"({self.dim},), eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(Module):
    """x / rms(x) * weight over the last axis."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: Any = float32) -> None:
        super().__init__()
        self.dim = int(dim)
        self.eps = float(eps)
        self.weight = Parameter._filled((self.dim,), dtype, 1.0)

    def forward(self, x: Any, out: F.Out = None) -> np.ndarray:
        return F.rms_norm(x, self.dim, self.weight.data, self.eps, out=out)

    def extra_repr(self) -> str:
        return f"({self.dim},), eps={self.eps}"


class GELU(Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Any) -> np.ndarray:
        return F.gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SiLU(Module):
    def forward(self, x: Any) -> np.ndarray:
        return F.silu(x)


class Identity(Module):
    def forward(self, x: Any) -> Any:
        return x


__all__ = ["Linear", "LayerNorm", "RMSNorm", "GELU", "SiLU", "Identity"]
