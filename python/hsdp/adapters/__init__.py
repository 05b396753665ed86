"""Tensor adapters: how hsdp reaches a framework's modules and parameters.

:func:`adapter_for` finds the adapter that owns a module; :func:`register_adapter` adds
one (tried before the built-in ones); both are the engine's registry (``hsdp.engine.registry``),
which the built-in adapters join here. The protocol is the engine's port,
:class:`TensorAdapter` in ``hsdp.engine.port``.
Built in: ``numpy`` (``hsdp.nn``) and ``torch`` (``torch.nn.Module``); the torch adapter is
imported and registered only once torch itself has been imported by the program, so
``import hsdp`` never imports torch.
"""

from __future__ import annotations

import sys

from ..engine import registry
from ..engine.port import TensorAdapter
from ..engine.registry import adapter_for, register_adapter
from .numpy import NumpyAdapter

NUMPY = NumpyAdapter()
registry.register_adapter(NUMPY, last=True)
_torch_registered = False


def _register_torch() -> None:
    """Adds the torch adapter once the program has imported torch (a torch module implies it)."""
    global _torch_registered
    if _torch_registered or "torch" not in sys.modules:
        return
    from .torch import TorchAdapter

    registry.register_adapter(TorchAdapter(), last=True)
    _torch_registered = True


registry.on_lookup(_register_torch)


def unregister_adapter(adapter: TensorAdapter) -> None:
    if adapter is NUMPY:
        raise ValueError("the built-in NumPy adapter cannot be removed")
    registry.remove_adapter(adapter)


__all__ = ["NUMPY", "NumpyAdapter", "TensorAdapter", "adapter_for", "register_adapter", "unregister_adapter"]
