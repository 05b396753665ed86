"""Tensor adapters: how hsdp reaches a framework's modules and parameters.

:func:`adapter_for` finds the adapter that owns a module; :func:`register_adapter` adds
one (tried before the built-in ones). The protocol is :class:`TensorAdapter` in ``base``.
Built in: ``numpy`` (``hsdp.nn``). torch modules are recognised but not supported yet.
"""

from __future__ import annotations

import sys
from typing import Any

from .base import TensorAdapter
from .numpy import NumpyAdapter

NUMPY = NumpyAdapter()
_adapters: list[TensorAdapter] = [NUMPY]


def register_adapter(adapter: TensorAdapter) -> None:
    """Make ``adapter`` the first one asked whether it owns a module."""
    if adapter in _adapters:
        _adapters.remove(adapter)
    _adapters.insert(0, adapter)


def unregister_adapter(adapter: TensorAdapter) -> None:
    if adapter is NUMPY:
        raise ValueError("the built-in NumPy adapter cannot be removed")
    _adapters.remove(adapter)


def _is_torch_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # never imported here: a torch module implies torch is loaded
    if torch is not None and isinstance(obj, torch.nn.Module):
        return True
    return hasattr(obj, "named_modules") and type(obj).__module__.split(".")[0] in ("torch", "diffusers")


def adapter_for(module: Any, what: str = "model") -> TensorAdapter:
    """The adapter that owns ``module``; a clear error naming its class when none does."""
    for adapter in _adapters:
        if adapter.owns(module):
            return adapter
    if _is_torch_module(module):
        raise NotImplementedError(
            f"{what} is a torch module ({type(module).__name__}); the torch adapter (zero-copy views "
            "through DLPack) is not built yet. Build the model with hsdp.nn for now."
        )
    raise TypeError(f"{what} must be an hsdp.nn.Module, got {type(module).__name__}")


__all__ = ["NUMPY", "NumpyAdapter", "TensorAdapter", "adapter_for", "register_adapter", "unregister_adapter"]
