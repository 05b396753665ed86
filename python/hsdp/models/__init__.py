"""Reference diffusion transformer(s) used by examples, tests and benchmarks."""

from .dit import (
    PRESETS,
    VARIANTS,
    Attention,
    DiTBlock,
    DiTConfig,
    VideoDiT,
    VideoDiTIgnoredTimeEmbedder,
    init_weights,
    is_block,
    make_inputs,
    make_model,
    param_nbytes,
    preset_names,
    timestep_embedding,
)
from .quant import QuantLinear, VideoDiTQuantized

__all__ = [
    "DiTConfig",
    "PRESETS",
    "preset_names",
    "VARIANTS",
    "is_block",
    "Attention",
    "DiTBlock",
    "VideoDiT",
    "VideoDiTIgnoredTimeEmbedder",
    "VideoDiTQuantized",
    "QuantLinear",
    "timestep_embedding",
    "init_weights",
    "make_model",
    "make_inputs",
    "param_nbytes",
]
