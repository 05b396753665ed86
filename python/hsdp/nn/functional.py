"""Stateless NumPy ops with torch.nn.functional's names and argument order.

Everything computes in float32 (float64 only when every floating input is float64), returns a
fresh array (or fills the ``out=`` given to linear and rms_norm), and keeps no reference to
its inputs: the sharding engine frees parameter arrays as soon as a unit's forward returns.
All ops are deterministic for a given input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Union

import numpy as np


def compute_dtype(*arrays: np.ndarray | None) -> np.dtype:
    """float64 if every given array is float64, else float32 (NumPy has no bf16/f8 math)."""
    present = [a for a in arrays if a is not None]
    if present and all(a.dtype == np.float64 for a in present):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


Out = Union[np.ndarray, Callable[[np.dtype], np.ndarray], None]


def _out_array(out: Out, shape: tuple[int, ...], dtype: np.dtype, what: str) -> np.ndarray:
    """``out``, or what it returns given the result's dtype (so that a caller need not read
    weights a hook has not gathered yet to know it). It has the result's shape, or the
    result's with the last axis split in two: a view of a head-group-major buffer
    (``hsdp.parallel.Ulysses.grouped``), written by a step the function makes anyway, so the
    layout needs no pass of its own."""
    if callable(out):
        out = out(dtype)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{what}: out must be a NumPy array or a function of the dtype returning one, not "
                        f"{type(out).__name__}")
    lead = len(shape) - 1
    if (out.dtype != dtype or out.shape[:lead] != shape[:-1] or out.ndim - lead not in (1, 2)
            or math.prod(out.shape[lead:]) != shape[-1]):
        raise ValueError(f"{what}: out of shape {out.shape} and dtype {out.dtype} cannot hold a result of shape "
                         f"{shape} and dtype {dtype} (its shape, or its last axis split in two)")
    return out


def linear(x: Any, weight: np.ndarray, bias: np.ndarray | None = None, out: Out = None) -> np.ndarray:
    """``x @ weight.T + bias`` over the last axis of ``x``; weight is (out, in). ``out``: where
    the result goes, of its shape or with its last axis split in two, or a function of the
    result's dtype returning it (see ``_out_array``)."""
    x = np.asarray(x)
    if x.ndim == 0 or weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input of shape {x.shape} does not match weight of shape {weight.shape}")
    ct = compute_dtype(x, weight, bias)
    w = weight.astype(ct, copy=False)
    lead = x.shape[:-1]
    # One 2-D GEMM instead of a batched matmul: one BLAS call, the same kernel every time.
    y = np.matmul(x.reshape(-1, x.shape[-1]).astype(ct, copy=False), w.T).reshape(*lead, w.shape[0])
    if out is None:
        if bias is not None:
            y += bias.astype(ct, copy=False)
        return y
    # the bias added on the way into out (the same bits as in place); without one, a copy
    out = _out_array(out, y.shape, ct, "linear")
    if bias is None:
        np.copyto(out, y.reshape(out.shape))
    else:
        tail = out.shape[y.ndim - 1:]  # the last axis, whole or split
        np.add(y.reshape(out.shape), bias.astype(ct, copy=False).reshape(tail), out=out)
    return out


def _norm_axes(x: np.ndarray, normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, (int, np.integer)) else tuple(normalized_shape)
    if tuple(x.shape[x.ndim - len(shape):]) != tuple(int(s) for s in shape):
        raise ValueError(f"normalized_shape {shape} does not match the trailing dimensions of input {x.shape}")
    return tuple(range(-len(shape), 0))


def layer_norm(
    x: Any,
    normalized_shape: int | Sequence[int],
    weight: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    eps: float = 1e-5,
) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) over the trailing ``normalized_shape`` axes (biased var)."""
    x = np.asarray(x)
    axes = _norm_axes(x, normalized_shape)
    ct = compute_dtype(x, weight, bias)
    xc = x.astype(ct, copy=False)
    mean = xc.mean(axis=axes, keepdims=True)
    d = xc - mean
    var = np.mean(d * d, axis=axes, keepdims=True)
    y = d / np.sqrt(var + ct.type(eps))
    if weight is not None:
        y *= weight.astype(ct, copy=False)
    if bias is not None:
        y += bias.astype(ct, copy=False)
    return y


def rms_norm(
    x: Any,
    normalized_shape: int | Sequence[int],
    weight: np.ndarray | None = None,
    eps: float | None = None,
    out: Out = None,
) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight; eps None means the compute dtype's machine epsilon.
    ``out``: where the result goes, as for ``linear``."""
    x = np.asarray(x)
    axes = _norm_axes(x, normalized_shape)
    ct = compute_dtype(x, weight)
    xc = x.astype(ct, copy=False)
    e = np.finfo(ct).eps if eps is None else eps
    rms = np.sqrt(np.mean(xc * xc, axis=axes, keepdims=True) + ct.type(e))
    if out is None:
        y = xc / rms
        if weight is not None:
            y *= weight.astype(ct, copy=False)
        return y
    # the division writes out directly: no pass more than without out, the same bits
    out = _out_array(out, xc.shape, ct, "rms_norm")
    if out.ndim != xc.ndim and len(axes) != 1:
        raise ValueError(f"rms_norm: out with its last axis split needs a normalized_shape of one axis, not "
                         f"{len(axes)}")
    tail = out.shape[xc.ndim - 1:]  # the last axis, whole or split
    np.divide(xc.reshape(out.shape), rms.reshape(rms.shape[:-1] + (1,) * len(tail)), out=out)
    if weight is not None:
        w = weight.astype(ct, copy=False)
        out *= w if out.ndim == xc.ndim else w.reshape(tail)  # broadcast as without out
    return out


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
# Exact erf, element by element: NumPy has no erf. The reference model uses the tanh form.
_erf = np.frompyfunc(math.erf, 1, 1)


def gelu(x: Any, approximate: str = "none") -> np.ndarray:
    """0.5 x (1 + erf(x / sqrt 2)); approximate="tanh": 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))."""
    x = np.asarray(x)
    ct = compute_dtype(x)
    xc = x.astype(ct, copy=False)
    if approximate == "tanh":
        inner = ct.type(_SQRT_2_OVER_PI) * (xc + ct.type(0.044715) * xc * xc * xc)
        return ct.type(0.5) * xc * (ct.type(1.0) + np.tanh(inner))
    if approximate == "none":
        erf = _erf(xc.astype(np.float64) / math.sqrt(2.0)).astype(np.float64)
        return (0.5 * xc.astype(np.float64) * (1.0 + erf)).astype(ct)
    raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def sigmoid(x: Any) -> np.ndarray:
    """1 / (1 + exp(-x)) without overflow: exp is only taken of -|x|."""
    x = np.asarray(x)
    ct = compute_dtype(x)
    xc = x.astype(ct, copy=False)
    e = np.exp(-np.abs(xc))
    return np.where(xc >= 0, ct.type(1.0) / (ct.type(1.0) + e), e / (ct.type(1.0) + e))


def silu(x: Any) -> np.ndarray:
    """x * sigmoid(x)."""
    x = np.asarray(x)
    return x.astype(compute_dtype(x), copy=False) * sigmoid(x)


def softmax(x: Any, axis: int = -1) -> np.ndarray:
    """exp(x - max) / sum: subtracting the max keeps exp from overflowing."""
    x = np.asarray(x)
    xc = x.astype(compute_dtype(x), copy=False)
    e = np.exp(xc - xc.max(axis=axis, keepdims=True))
    e /= e.sum(axis=axis, keepdims=True)
    return e


def scaled_dot_product_attention(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> np.ndarray:
    """softmax(q k^T * scale + mask) v for (B, H, L, D) queries and (B, H, S, D) keys/values.

    attn_mask: boolean (True = attend) or additive, broadcastable to (B, H, L, S).
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    if q.ndim < 2 or k.shape[-1] != q.shape[-1] or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"incompatible attention shapes q {q.shape}, k {k.shape}, v {v.shape}")
    ct = compute_dtype(q, k, v)
    s = ct.type(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    scores = np.matmul(q.astype(ct, copy=False), np.swapaxes(k.astype(ct, copy=False), -1, -2))
    scores *= s
    if is_causal:
        L, S = scores.shape[-2], scores.shape[-1]
        scores = np.where(np.tril(np.ones((L, S), dtype=bool)), scores, ct.type(-np.inf))
    if attn_mask is not None:
        if attn_mask.dtype == np.bool_:
            scores = np.where(attn_mask, scores, ct.type(-np.inf))
        else:
            scores = scores + attn_mask.astype(ct, copy=False)
    return np.matmul(softmax(scores, axis=-1), v.astype(ct, copy=False))


__all__ = [
    "linear",
    "layer_norm",
    "rms_norm",
    "gelu",
    "sigmoid",
    "silu",
    "softmax",
    "scaled_dot_product_attention",
]
