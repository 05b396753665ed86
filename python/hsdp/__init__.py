"""hsdp: shard the weights of a diffusion transformer across the ranks of a job.

Every rank keeps 1/S of each block's weights; a block's full weights exist only while it
computes. The heavy lifting (mesh, flat shard layout, collectives, casts) is the C core in
``hsdp._C``; this package walks module trees and holds the hooks. Importing it initialises
nothing: MPI starts on the first process-group use.
"""

from __future__ import annotations

from . import _C, _public, adapters
from .engine import dtypes, trace
from .engine.dtypes import DType, bfloat16, float16, float32, float64, float8_e4m3fn, float8_e5m2
from .engine.api import (
    HSDPInferenceConfig,
    HSDPShardContext,
    apply_hsdp_to_model,
    empty_pool,
    set_pool_capacity,
    finalize_hsdp_root,
    full_state_dict,
    get_units,
    memory_stats,
    prepare_hsdp_shard_context,
    reshard,
    resident,
    residency_stats,
    shard_hsdp_module,
    shard_model,
    unshard,
)
from .world.mesh import DeviceMesh, init_device_mesh
from .engine.policy import MixedPrecisionPolicy
from .engine.wire import WireError, wire_error

__version__ = "0.1.0"

_public.install()  # hsdp.distributed, hsdp.config, python -m hsdp.launch, ...: their homes (hsdp._public)


def __getattr__(name: str) -> object:
    # Submodules that pull in more than the core are loaded on first use.
    if name in ("nn", "models", "checkpoint", "pipelines", "testing", "parallel") or f"hsdp.{name}" in _public.PUBLIC_MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name == "DiffusionParallelConfig":
        from .engine.config import DiffusionParallelConfig

        return DiffusionParallelConfig
    if name in ("Omni", "OmniDiffusionSamplingParams", "OmniRequestOutput"):  # vllm-omni's API (no torch)
        from . import omni

        return getattr(omni, name)
    if name in ("load_model_sharded", "save_checkpoint", "load_checkpoint"):
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'hsdp' has no attribute {name!r}")


__all__ = [
    "DType", "DeviceMesh", "DiffusionParallelConfig", "HSDPInferenceConfig", "HSDPShardContext",
    "MixedPrecisionPolicy", "adapters", "apply_hsdp_to_model", "bfloat16", "dtypes", "empty_pool", "set_pool_capacity", "finalize_hsdp_root",
    "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "full_state_dict", "get_units",
    "init_device_mesh", "load_checkpoint", "load_model_sharded", "memory_stats", "prepare_hsdp_shard_context", "reshard",
    "resident", "residency_stats", "save_checkpoint", "shard_hsdp_module", "shard_model", "trace", "unshard",
    "WireError", "wire_error", "Omni", "OmniDiffusionSamplingParams", "OmniRequestOutput",
]
