"""The tensor adapter protocol, re-exported: it is the engine's port and lives in
:mod:`hsdp.engine.port` (the interface on the side of the code that calls it). Adapters and
older imports (``hsdp.adapters.base.TensorAdapter``) keep working through this name."""

from __future__ import annotations

from ..engine.port import TensorAdapter

__all__ = ["TensorAdapter"]
