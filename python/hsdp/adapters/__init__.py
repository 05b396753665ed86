"""Tensor adapters: how hsdp reaches a framework's modules and parameters.

:func:`adapter_for` finds the adapter that owns a module; :func:`register_adapter` adds
one (tried before the built-in ones). The protocol is :class:`TensorAdapter` in ``base``.
Built in: ``numpy`` (``hsdp.nn``) and ``torch`` (``torch.nn.Module``); the torch adapter is
imported and registered only once torch itself has been imported by the program, so
``import hsdp`` never imports torch.
"""

from __future__ import annotations

import sys
from typing import Any

from .base import TensorAdapter
from .numpy import NumpyAdapter

NUMPY = NumpyAdapter()
_adapters: list[TensorAdapter] = [NUMPY]
_torch_registered = False


def _register_torch() -> None:
    """Adds the torch adapter once the program has imported torch (a torch module implies it)."""
    global _torch_registered
    if _torch_registered or "torch" not in sys.modules:
        return
    from .torch import TorchAdapter

    _adapters.append(TorchAdapter())
    _torch_registered = True


def register_adapter(adapter: TensorAdapter) -> None:
    """Make ``adapter`` the first one asked whether it owns a module."""
    if adapter in _adapters:
        _adapters.remove(adapter)
    _adapters.insert(0, adapter)


def unregister_adapter(adapter: TensorAdapter) -> None:
    if adapter is NUMPY:
        raise ValueError("the built-in NumPy adapter cannot be removed")
    _adapters.remove(adapter)


def adapter_for(module: Any, what: str = "model") -> TensorAdapter:
    """The adapter that owns ``module``; a clear error naming its class when none does."""
    _register_torch()
    for adapter in _adapters:
        if adapter.owns(module):
            return adapter
    raise TypeError(
        f"{what} must be a torch.nn.Module or an hsdp.nn.Module, got {type(module).__module__}.{type(module).__name__}"
    )


__all__ = ["NUMPY", "NumpyAdapter", "TensorAdapter", "adapter_for", "register_adapter", "unregister_adapter"]
