"""Measuring what a float8 wire (``HSDPInferenceConfig(wire_dtype="float8_e4m3fn")``) costs in
precision: every parameter as the wire gives it back, against a reference copy of the same
weights (a state dict the model was built from, say).

The rule and its bound are in docs/performance.md#float8-on-the-wire: blocks of 128 weights
of a rank's piece of a parameter share one float32 scale (absmax / 448), so each weight is
off by at most 2^-4 of itself (e4m3 keeps 3 mantissa bits) plus 2^-10 of its block's scale,
and then one rounding to the parameter's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .api import full_state_dict, get_units

# The documented bound on a model's output with a float8 wire (docs/user-guide.md, "Float8 on
# the wire"): its relative L2 error against the same run without the wire. `hsdp generate
# --verify` checks it, and says so, when the wire is on: the wire is lossy by design, so the
# exact check's absolute tolerance does not apply.
OUTPUT_REL_L2_BOUND = 0.05


@dataclass(frozen=True)
class WireError:
    """One parameter's error: the largest |wire - reference|, the largest |reference|, and
    the relative L2 error ||wire - reference|| / ||reference|| (0 when both are zero)."""

    max_abs_error: float
    max_abs_value: float
    rel_l2: float


def _as_float64(value: Any) -> Any:
    import numpy as np

    if hasattr(value, "detach"):  # torch: NumPy has no bfloat16, so widen first
        value = value.detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


def wire_error(model: Any, reference: dict[str, Any]) -> dict[str, WireError]:
    """Per parameter that travels as float8, its error against ``reference[name]`` (the same
    weights, unquantized, in any dtype). A collective call (it gathers every unit: every rank
    calls it). Parameters the wire leaves alone are not listed; a quantized one missing from
    ``reference`` or of another shape is a ValueError naming it."""
    import numpy as np

    quantized = {
        name
        for st in get_units(model)
        for name, flag in zip(st.names, st.unit.wire_params)
        if flag
    }
    full = full_state_dict(model)
    out: dict[str, WireError] = {}
    for name in sorted(quantized):
        if name not in reference:
            raise ValueError(f"wire_error: parameter '{name}' travels as float8 but the reference has no such key")
        got, want = _as_float64(full[name]), _as_float64(reference[name])
        if got.shape != want.shape:
            raise ValueError(f"wire_error: parameter '{name}' has shape {got.shape} but the reference's is {want.shape}")
        finite = np.isfinite(want)
        d = np.where(finite, got - want, 0.0)
        w = np.where(finite, want, 0.0)
        ref_norm = math.sqrt(float((w * w).sum()))
        err_norm = math.sqrt(float((d * d).sum()))
        out[name] = WireError(
            max_abs_error=float(np.abs(d).max(initial=0.0)),
            max_abs_value=float(np.abs(w).max(initial=0.0)),
            rel_l2=err_norm / ref_norm if ref_norm else 0.0,
        )
    return out
