"""Diffusers pipelines with every model sharded rank-locally by HSDP.

    pipe = hsdp.pipelines.load_pipeline("Wan2.2-T2V-A14B-Diffusers", DiffusionParallelConfig(...))
    frames = hsdp.pipelines.generate(pipe, prompt="...", num_frames=81)  # rank 0: the output

See docs/pipelines.md. torch and diffusers are imported on first use of this package.
"""

from __future__ import annotations

from .cfg import GUIDANCE_PROBES, CFGSplit
from .components import PipelineFolderError
from .conditions import register_shard_conditions, shard_conditions_for
from .generate import generate
from .loader import load_pipeline
from .state import ComponentState, PipelineState, pipeline_state

__all__ = [
    "CFGSplit", "ComponentState", "GUIDANCE_PROBES", "PipelineFolderError", "PipelineState", "generate",
    "load_pipeline", "pipeline_state", "register_shard_conditions", "shard_conditions_for",
]
