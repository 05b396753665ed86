"""What is built: the one table of the features a config may declare and whether the runtime
executes them. The parallel config, the parallel groups and the sharding API read it; a
feature declared but not built is a NotImplementedError naming it, raised before anything
runs. Whether a backend (MPI, NCCL) is built is the C registry's answer
(``distributed.backend_reason``), not listed here.
"""

from __future__ import annotations

from typing import Any

from .. import _C

# Each parallel degree of DiffusionParallelConfig: the feature that executes it, and whether
# it is built. Ulysses, ring attention and CFG parallel run (hsdp.parallel, hsdp.ring,
# hsdp.parallel_torch). A config may still declare the others (the HSDP mesh over those
# ranks is valid), but a model run with them would silently compute redundantly instead of
# in parallel, so callers that run the model check them first (require_degrees_built).
PARALLEL_DEGREES: dict[str, tuple[str, bool]] = {
    "ulysses_degree": ("Ulysses sequence parallelism", True),
    "ring_degree": ("ring attention", True),
    "cfg_parallel_size": ("CFG parallelism", True),
    "tensor_parallel_size": ("tensor parallelism", False),
    "pipeline_parallel_size": ("pipeline parallelism", False),
    "data_parallel_size": ("data parallelism", True),
    "enable_expert_parallel": ("expert parallelism", False),
}

# Wire formats (shards held and gathered block-scaled) built. Which devices decode them is
# the device's answer (its table's wire_missing; devices.prepare_wire), not listed here.
# Formats a user may ask for that are not built, with why.
WIRE_DTYPES: tuple[str, ...] = ("float8_e4m3fn",)
# Why each is not built, as the C core says it (HSDPInferenceConfig refuses them itself).
WIRE_NOT_BUILT: dict[str, str] = dict(_C.WIRE_NOT_BUILT)


def _declared(value: Any) -> bool:
    return value is True or (not isinstance(value, bool) and value is not None and value > 1)


def not_built_degrees(config: Any) -> dict[str, list[str]]:
    """feature -> ["name=value", ...] for every degree ``config`` declares (> 1, or True) whose
    feature is not built, in the table's order."""
    out: dict[str, list[str]] = {}
    for name, (feature, built) in PARALLEL_DEGREES.items():
        value = getattr(config, name)
        if not built and _declared(value):
            out.setdefault(feature, []).append(f"{name}={value}")
    return out


def require_degrees_built(config: Any, tail: str) -> None:
    """NotImplementedError naming every declared degree that is not built, then ``tail``."""
    features = not_built_degrees(config)
    if not features:
        return
    parts = [f"{feature} ({', '.join(items)})" for feature, items in features.items()]
    verb = "is" if len(parts) == 1 else "are"
    raise NotImplementedError(f"{' and '.join(parts)} {verb} not built yet; {tail}")


def check_wire_dtype(name: str, what: str = "wire_dtype") -> None:
    """NotImplementedError for a wire format that is not built, naming the parameter ``what``
    (``hsdp_wire_dtype`` for DiffusionParallelConfig). Unknown names are the caller's ValueError."""
    if name in WIRE_NOT_BUILT:
        raise NotImplementedError(f"{what}={name!r} is not built: {WIRE_NOT_BUILT[name]}")
