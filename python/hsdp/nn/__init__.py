"""The PyTorch-like runtime on NumPy: the ``torch.nn.Module`` protocol hsdp walks, with no
framework installed. See docs/design.md, section 5."""

from . import functional
from .init import is_meta_init, meta_init
from .layers import GELU, Identity, LayerNorm, Linear, RMSNorm, SiLU
from .module import Module, ModuleList, RemovableHandle, Sequential, StateDictError
from .parameter import Parameter

__all__ = [
    "Parameter",
    "Module",
    "ModuleList",
    "Sequential",
    "RemovableHandle",
    "StateDictError",
    "Linear",
    "LayerNorm",
    "RMSNorm",
    "GELU",
    "SiLU",
    "Identity",
    "functional",
    "meta_init",
    "is_meta_init",
]
