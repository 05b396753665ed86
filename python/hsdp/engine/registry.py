"""The registry of tensor adapters the engine shards through: :func:`adapter_for` finds the
one that owns a module. The engine knows only this registry and the protocol
(``hsdp.engine.port.TensorAdapter``); the adapters register themselves from the layer
above (``hsdp.adapters``), so no import runs from the engine up to a framework."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .port import TensorAdapter

_adapters: list[TensorAdapter] = []
# Called before each lookup: a hook registers an adapter once its framework is there
# (the torch adapter once the program has imported torch).
_before_lookup: list[Callable[[], None]] = []


def register_adapter(adapter: TensorAdapter, *, last: bool = False) -> None:
    """Make ``adapter`` the first one asked whether it owns a module (``last``: the last)."""
    if adapter in _adapters:
        _adapters.remove(adapter)
    if last:
        _adapters.append(adapter)
    else:
        _adapters.insert(0, adapter)


def remove_adapter(adapter: TensorAdapter) -> None:
    _adapters.remove(adapter)


def on_lookup(hook: Callable[[], None]) -> None:
    """Run ``hook`` before every :func:`adapter_for` (once added)."""
    if hook not in _before_lookup:
        _before_lookup.append(hook)


def adapter_for(module: Any, what: str = "model") -> TensorAdapter:
    """The adapter that owns ``module``; a clear error naming its class when none does."""
    for hook in _before_lookup:
        hook()
    for adapter in _adapters:
        if adapter.owns(module):
            return adapter
    raise TypeError(
        f"{what} must be a torch.nn.Module or an hsdp.nn.Module, got {type(module).__module__}.{type(module).__name__}"
    )
