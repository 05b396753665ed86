"""A weight-only int8 variant: packed integer weights with a scalar scale.

Its parameters are what hsdp calls unshardable (not floating point, or 0-dim): they are kept
whole on every rank, so this variant exercises that path of the engine.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..engine.dtypes import float32, int8
from ..nn.module import Module
from ..nn.parameter import Parameter
from .dit import VideoDiT


class QuantLinear(Module):
    """y = x @ (weight * scale).T + bias with an int8 weight (out, in) and a 0-dim float32 scale.

    ``dtype`` is accepted for signature compatibility with Linear and ignored: the weight is
    int8 and the scale and bias float32 whatever the rest of the model uses.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: Any = None) -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.weight = Parameter._filled((self.out_features, self.in_features), int8, 0)
        self.scale = Parameter._filled((), float32, 1.0)
        self.register_parameter("bias", Parameter._filled((self.out_features,), float32, 0.0) if bias else None)

    def forward(self, x: Any) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear: input of shape {x.shape} does not match in_features {self.in_features}")
        # Dequantise into a temporary that dies with this call (the engine may free the weight).
        w = self.weight.data.astype(np.float32) * self.scale.data
        y = np.matmul(x.reshape(-1, self.in_features), w.T)
        if self.bias is not None:
            y += self.bias.data
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


class VideoDiTQuantized(VideoDiT):
    """VideoDiT whose blocks' feed-forward Linears are QuantLinear (same module names)."""

    _ffn_linear: ClassVar[type[Module]] = QuantLinear


__all__ = ["QuantLinear", "VideoDiTQuantized"]
