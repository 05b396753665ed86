"""The torch adapter: sharding stock ``torch.nn.Module``s (diffusers' transformers, say).

Imported only once torch is (``hsdp.adapters.adapter_for`` registers it when it meets a
torch module), so ``import hsdp`` never pulls torch in.

- **Identity.** The ``nn.Parameter`` objects stay the same; only ``p.data`` changes. Inside a
  unit's forward it is a zero-copy view of the gathered buffer, exported from C through
  DLPack; outside it is a 0-element placeholder of the storage dtype. The true shape is kept
  in ``p._hsdp_shape``.
- **Dtypes.** torch computes in bfloat16 and float8, so the compute dtype is the storage
  dtype: nothing is widened, and the views are the gathered bytes themselves.
- **Hooks.** A pre-hook with kwargs and a post-hook with ``always_call=True``, so a forward
  that raises still reshards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..dtypes import DType, as_dtype

if TYPE_CHECKING:
    from ..units import UnitState

# torch dtypes NumPy has no type for: their raw bits go to the C unit as integers of their size
_RAW_AS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def _torch_dtype(d: DType) -> torch.dtype:
    return getattr(torch, "bool" if d.name == "bool" else d.name)


def _set_data(p: Any, t: torch.Tensor) -> None:
    """p.data = t, also across device types (a meta parameter given real values), keeping
    the Parameter object itself: torch refuses set_data between meta and CPU tensors, so the
    contents are swapped into the same Python object instead."""
    if p.device.type == t.device.type:
        p.data = t
        return
    new = torch.nn.Parameter(t, requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)
    torch.utils.swap_tensors(p, new)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


class _UnitViews:
    """What a unit's views need, computed once: per parameter its buffer, dtype, shape,
    strides and element offset."""

    __slots__ = ("slots",)

    def __init__(self, state: UnitState, adapter: TorchAdapter) -> None:
        self.slots = []
        for p, (which, offset), name in zip(state.params, state.unit.view_specs, state.unit.compute_dtypes):
            dt = _torch_dtype(as_dtype(name))
            item = torch.empty((), dtype=dt).element_size()
            shape = adapter.shape(p)
            self.slots.append((p, which, dt, shape, _strides(shape), offset // item))


class TorchAdapter:
    """:class:`~hsdp.adapters.base.TensorAdapter` for ``torch.nn.Module``."""

    name = "torch"
    bind_attr: str | None = None  # views are torch tensors: bound here, not by the C unit

    # -- modules ---------------------------------------------------------------------------
    def owns(self, module: Any) -> bool:
        return isinstance(module, torch.nn.Module)

    def named_parameters(self, module: Any, remove_duplicate: bool = True) -> Iterator[tuple[str, Any]]:
        return module.named_parameters(remove_duplicate=remove_duplicate)

    def add_hooks(self, module: Any, pre: Callable[..., Any], post: Callable[..., Any]) -> list[Any]:
        return [
            module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True, always_call=True),
        ]

    def move(self, module: Any, device: Any) -> None:
        module.to(device)

    def freeze(self, module: Any) -> None:
        for p in module.parameters():
            p.requires_grad_(False)

    def copy_state_dict(self, module: Any) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    # -- parameters ------------------------------------------------------------------------
    def dtype(self, p: Any) -> DType:
        return as_dtype(p.dtype)

    def shape(self, p: Any) -> tuple[int, ...]:
        saved = getattr(p, "_hsdp_shape", None)
        return saved if saved is not None else tuple(p.shape)

    def is_shardable(self, p: Any) -> bool:
        return len(self.shape(p)) > 0 and p.is_floating_point()

    def is_sharded(self, p: Any) -> bool:
        return getattr(p, "_hsdp_state", None) is not None

    def shard_source(self, p: Any) -> tuple[Any, str | None] | None:
        if p.is_meta:
            return None  # filled later by a loader
        t = p.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        raw = _RAW_AS.get(t.dtype)
        if raw is not None:
            return t.view(raw).numpy(), as_dtype(t.dtype).name
        return t.numpy(), None

    def values(self, p: Any) -> Any:
        return p.data

    def assign(self, p: Any, array: Any) -> None:
        # checkpoint arrays arrive in NumPy's compute dtype (bfloat16 widened): back to p's own
        _set_data(p, torch.from_numpy(np.ascontiguousarray(array)).to(p.dtype))

    def restore(self, p: Any, saved: Any) -> None:
        _set_data(p, saved)

    def unloaded(self, module: Any) -> list[str]:
        # buffers too: diffusers' RoPE tables are non-persistent buffers no checkpoint holds
        params = [n for n, p in module.named_parameters() if p.is_meta and not self.is_sharded(p)]
        return params + [n for n, b in module.named_buffers() if b.is_meta]

    def held_nbytes(self, params: Iterable[Any]) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    def mark_sharded(self, params: tuple[Any, ...], dtypes: tuple[DType, ...], state: str) -> None:
        for p, dt in zip(params, dtypes):
            p._hsdp_shape = tuple(p.shape)
            _set_data(p, self._placeholder(_torch_dtype(dt)))  # a meta parameter becomes a CPU one
            p._hsdp_state = state

    def _placeholder(self, dt: torch.dtype) -> torch.Tensor:
        # outside inference mode, so a parameter never becomes an inference tensor for good
        with torch.inference_mode(False):
            return torch.empty(0, dtype=dt)

    # -- dtypes and devices ----------------------------------------------------------------
    def compute_dtype(self, storage: DType) -> DType:
        return storage  # torch computes in bfloat16 and float8: no widening

    def check_device(self, target_device: Any) -> None:
        if target_device is None:
            return
        kind = torch.device(target_device).type
        if kind == "cuda":
            raise NotImplementedError(
                f"target_device {target_device!r}: GPU sharding needs the NCCL backend, which is not built yet; "
                "use 'cpu' (MPI ranks) for now"
            )
        if kind != "cpu":
            raise ValueError(f"target_device {target_device!r} is not supported; use 'cpu' or None")

    def buffer_device(self, target_device: Any) -> str:
        return "host"

    # -- forwards --------------------------------------------------------------------------
    def _cast(self, obj: Any, dt: torch.dtype) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.to(dt) if obj.is_floating_point() and obj.dtype != dt else obj
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._cast(x, dt) for x in obj)
        if isinstance(obj, list):
            return [self._cast(x, dt) for x in obj]
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            # diffusers' outputs (BaseOutput) are dataclasses
            fields = {f.name: self._cast(getattr(obj, f.name), dt) for f in dataclasses.fields(obj)}
            return dataclasses.replace(obj, **fields)
        if isinstance(obj, dict):
            return type(obj)((k, self._cast(v, dt)) for k, v in obj.items())
        return obj

    def cast_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: DType) -> tuple[Any, Any]:
        dt = _torch_dtype(dtype)
        return self._cast(args, dt), self._cast(kwargs, dt)

    def cast_output(self, output: Any, dtype: DType) -> Any:
        return self._cast(output, _torch_dtype(dtype))

    # -- binding ---------------------------------------------------------------------------
    def bind(self, state: UnitState) -> None:
        views = state.adapter_data
        if views is None:
            views = state.adapter_data = _UnitViews(state, self)
        bufs = state.unit.buffers()
        with torch.inference_mode(False):
            bases = [torch.from_dlpack(b) if b is not None else None for b in bufs]
            typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
            for p, which, dt, shape, strides, offset in views.slots:
                base = typed.get((which, dt))
                if base is None:
                    raw = bases[which]
                    item = torch.empty((), dtype=dt).element_size()
                    base = typed[(which, dt)] = raw[: raw.numel() - raw.numel() % item].view(dt)
                p.data = torch.as_strided(base, shape, strides, offset)

    def unbind(self, state: UnitState) -> None:
        views = state.adapter_data
        placeholders: dict[torch.dtype, torch.Tensor] = {}
        for p, _which, dt, _shape, _strides_, _offset in views.slots:
            ph = placeholders.get(dt)
            if ph is None:
                ph = placeholders[dt] = self._placeholder(dt)
            p.data = ph
