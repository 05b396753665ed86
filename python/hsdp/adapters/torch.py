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
- **Devices.** With ``target_device="cuda"`` the unsharded buffers are device memory of
  the NCCL backend, the views are CUDA tensors, and the placeholders are 0-element CUDA
  tensors (torch refuses ``p.data`` across device types). Shards are written on the host
  while loading and copied to the GPU by their first gather.
- **Leases.** Each bind imports every parameter's view of the gathered buffer through
  DLPack (``_C.dlpack_views``: one export per parameter, with its dtype, shape and strides;
  a device buffer: one ``__dlpack__`` import cut by ``as_strided``). Each export is a lease,
  which torch returns (the DLPack deleter) when the last tensor on its storage dies. Unbind drops
  the adapter's own tensors, so the lease comes back before the unit gives the buffer to the
  pool; a view a user keeps holds the lease, and the pool does not reuse that buffer (see
  ``[Note: leases]`` in docs/design.md).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import _C
from ..world import devices
from ..engine.dtypes import DType, as_dtype
from ..engine.units import PARAM_WATCH

if TYPE_CHECKING:
    from ..engine.units import UnitState

# torch dtypes NumPy has no type for: their raw bits go to the C unit as integers of their size
_RAW_AS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


_TORCH_DTYPES: dict[str, torch.dtype] = {}


def as_numpy(t: torch.Tensor) -> Any:
    """A contiguous CPU tensor's bytes as a NumPy array, zero-copy (bfloat16 and float8 as
    integers of their size, as this adapter hands them to the C unit)."""
    raw = _RAW_AS.get(t.dtype)
    return (t.view(raw) if raw is not None else t).numpy()


def _stream(t: torch.Tensor) -> int | None:
    """torch's current stream on t's device: a device collective runs after the work that
    made its input there, and before the work that reads its output (None: a device viewed
    as the CPU has no streams)."""
    return int(torch.cuda.current_stream(t.device).cuda_stream) if t.is_cuda else None


def _on_device(group: Any, t: torch.Tensor) -> bool:
    """Whether t lives on the group's device (its backend's device table says which framework
    device type that is): then the collective runs on the tensor itself."""
    info = devices.of_group(group)
    return info.on_device and t.device.type == info.framework


def _torch_dtype(d: DType) -> torch.dtype:
    dt = _TORCH_DTYPES.get(d)
    if dt is None:
        dt = _TORCH_DTYPES[str.__str__(d)] = getattr(torch, str.__str__(d))
    return dt


# torch.from_dlpack's Python wrapper costs microseconds per call on the hot path; the
# capsule route underneath is the same conversion. Versioned capsules are understood only
# by the torch releases that can also make them (2.9 on); older ones take the legacy form.
_capsule_to_tensor = getattr(torch._C, "_from_dlpack", None)
_inference_mode = torch.is_inference_mode_enabled
_VERSIONED = hasattr(torch._C, "_to_dlpack_versioned")


# DLPack's (type code, bits) of the dtypes a parameter is viewed in (kDLFloat 2, kDLBfloat 4,
# kDLFloat8_e4m3fn 10, kDLFloat8_e5m2 12: DLPack 1.1)
_DLPACK_TYPES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16), torch.float64: (2, 64),
                 torch.float8_e4m3fn: (10, 8), torch.float8_e5m2: (12, 8)}


def _from_dlpack(buf: Any) -> torch.Tensor:
    if _capsule_to_tensor is None:
        return torch.from_dlpack(buf)
    return _capsule_to_tensor(buf.__dlpack__(max_version=(1, 0)) if _VERSIONED else buf.__dlpack__())


def _set_data(p: Any, t: torch.Tensor) -> None:
    """p.data = t, also across device types (a meta parameter given real values), keeping
    the Parameter object itself: torch refuses set_data between meta and CPU tensors, so the
    contents are swapped into the same Python object instead."""
    # an inference parameter (built under inference_mode) cannot take normal data in place
    if p.device.type == t.device.type and not (p.is_inference() and not t.is_inference()):
        p.data = t
        return
    if isinstance(p, torch.nn.Parameter):
        new = torch.nn.Parameter(t, requires_grad=p.requires_grad)
        new.__dict__.update(p.__dict__)
    else:  # a buffer: stays a plain tensor
        new = t.clone() if t._base is not None else t
    torch.utils.swap_tensors(p, new)


def _on_parameter_registered(module: Any, name: str, param: Any) -> None:
    # torch's global parameter-registration hook: the unit of a replaced sharded parameter
    # is told (hsdp.engine.units.UnitState._watch_replacements); any other module pays one lookup
    watch = module.__dict__.get(PARAM_WATCH)
    if watch is not None and name in watch:
        watch[name](param)


torch.nn.modules.module.register_module_parameter_registration_hook(_on_parameter_registered)


def _refuse_sharded_state_dict(module: Any, prefix: str, keep_vars: bool) -> None:
    """A sharded unit's parameters are 0-element placeholders: a state dict of them (and so
    save_pretrained) would be empty tensors, silently. Refused, unless the unit is unsharded
    (hsdp.full_state_dict, hsdp.resident, hsdp.unshard)."""
    st = getattr(module, "_hsdp_unit", None)
    if st is not None and not st.unit.is_unsharded:
        raise RuntimeError(
            f"the parameters of '{prefix.rstrip('.') or type(module).__name__}' are sharded by hsdp (unit "
            f"'{st.label}'); use hsdp.full_state_dict(model) for the gathered state dict"
        )


# [Note: compile] torch.compile meets hsdp at its hooks, and they stay out of its graphs.
# A unit's pre-hook gathers (a C collective on MPI or NCCL, with a prefetch schedule, a
# residency budget and DLPack leases) and binds each parameter's .data to a view of the
# gathered buffer; its post-hook rebinds the 0-element placeholders. None of that is a
# tensor op Dynamo could trace, and the bind is what makes a parameter whole: traced
# through, Dynamo reads a parameter at whatever it held while tracing (the issue's
# "broadcast a dimension of length 64": a shard-shaped fake where a whole weight belongs).
# So each hook is a graph break, run eagerly, and the graphs read the parameters as
# their inputs only after the pre-hook bound them, as FSDP2 without compiled autograd
# does. Chosen over a custom op for the gather because:
# - a unit boundary is already a block boundary, where compile_repeated_blocks (diffusers'
#   regional compile, the recommended path) puts its graph edges anyway: torch.compile(model)
#   costs one break per unit, a few microseconds beside a block's compute;
# - the gather's Python state (the schedule's order and prefetch, residency, resharding,
#   the float8 wire's decode, leases) would have to become a graph's side effects, and a
#   graph that held a parameter's storage could not give it back to the pool.
# Guards then see the same shapes and strides every call (a view of a fresh buffer, or a
# resident unit's kept one), so resharding and residency changes recompile nothing; a
# parameter read outside its unit's forward is the 0-element placeholder, which fails the
# guards (a recompile) instead of computing on a shard. The wrapper asks
# torch.compiler.is_compiling() (True only while Dynamo traces) so that eager forwards skip
# torch.compiler.disable's context switch (0.2 us a call); Dynamo folds the test and breaks
# at the disabled call. The sequence-parallel hooks and exchanges are kept out the same way
# (hsdp.parallel.context, hsdp.parallel.attention).
_is_compiling = torch.compiler.is_compiling


def outside_graphs(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook`, run eagerly when torch.compile traces a forward: a graph break, never traced
    ([Note: compile]); eager forwards call it directly."""
    eager = torch.compiler.disable(hook)

    def run(*args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return eager(*args, **kwargs)
        return hook(*args, **kwargs)

    return run


# The unit hooks run twice per unit per forward: their wrappers take torch's fixed arguments
# (with_kwargs=True) rather than *args/**kwargs, whose packing cost bench_torch.py --hooks
# 1.5-2 us a unit (8.5 -> 10-12 us); spelled out, it is within that bench's noise.
def _pre_hook_outside_graphs(hook: Callable[[Any, Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
    eager = torch.compiler.disable(hook)

    def run(module: Any, args: Any, kwargs: Any) -> Any:
        if _is_compiling():
            return eager(module, args, kwargs)
        return hook(module, args, kwargs)

    return run


def _post_hook_outside_graphs(hook: Callable[[Any, Any, Any, Any], Any]) -> Callable[[Any, Any, Any, Any], Any]:
    eager = torch.compiler.disable(hook)

    def run(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        if _is_compiling():
            return eager(module, args, kwargs, output)
        return hook(module, args, kwargs, output)

    return run


_LEAVES = (int, float, bool, str, type(None))


def _all_in(values: Iterable[Any], dt: torch.dtype) -> bool:
    """True when no value needs a cast to dt: tensors of dt or not floating, plain scalars.
    Containers answer False (the full walk decides)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.dtype != dt and v.is_floating_point():
                return False
        elif type(v) not in _LEAVES:
            return False
    return True


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


class _UnitViews:
    """What a unit's views need, computed once: the typed bases to cut from its buffers and,
    per parameter, its base, shape, strides and element offset."""

    __slots__ = ("bases", "slots", "params", "placeholders", "single", "host_spec")

    def __init__(self, state: UnitState, adapter: TorchAdapter) -> None:
        keys: dict[tuple[int, torch.dtype], int] = {}
        self.slots = []
        for p, (which, offset), name in zip(state.params, state.unit.view_specs, state.unit.compute_dtypes):
            dt = _torch_dtype(as_dtype(name))
            shape = adapter.shape(p)
            base = keys.setdefault((which, dt), len(keys))
            self.slots.append((p, base, shape, _strides(shape), offset // dt.itemsize, dt))
        self.bases = list(keys)  # (buffer index, dtype)
        # the common case, cut without lists: every parameter from the gathered buffer, in one dtype
        self.single = (self.bases[0][1], [(p, shape, strides, offset) for p, _b, shape, strides, offset, _dt in self.slots]
                       ) if len(self.bases) == 1 and self.bases[0][0] == 0 else None
        device = state.unit.device
        # ... and, for _C.dlpack_views, each parameter as its own DLPack export (int64s: byte
        # offset, type code, bits, ndim, shape, strides), when torch imports capsules directly
        # and the buffers are host memory (dlpack_views exports host buffers; a device buffer
        # goes through __dlpack__): what bind checks once per call
        self.host_spec: bytes | None = None
        if (device == devices.HOST and self.single is not None and _capsule_to_tensor is not None
                and self.single[0] in _DLPACK_TYPES):
            code, bits = _DLPACK_TYPES[self.single[0]]
            spec: list[int] = []
            for _p, shape, strides, offset in self.single[1]:
                spec += [offset * (bits // 8), code, bits, len(shape), *shape, *strides]
            self.host_spec = np.array(spec, dtype=np.int64).tobytes()
        self.params = [slot[0] for slot in self.slots]
        # (parameter, its placeholder) pairs: what unbind sets, zipped once
        self.placeholders = tuple(zip(self.params, (adapter._placeholder(slot[5], device) for slot in self.slots)))


class TorchAdapter:
    """:class:`~hsdp.adapters.base.TensorAdapter` for ``torch.nn.Module``."""

    name = "torch"
    bind_attr: str | None = None  # views are torch tensors: bound here, not by the C unit

    def __init__(self) -> None:
        self._placeholders: dict[tuple[torch.dtype, str], torch.Tensor] = {}
        # where whole parameters given values by a loader go when they are still meta
        self._target: torch.device | None = None

    # -- modules ---------------------------------------------------------------------------
    def owns(self, module: Any) -> bool:
        return isinstance(module, torch.nn.Module)

    def named_parameters(self, module: Any, remove_duplicate: bool = True) -> Iterator[tuple[str, Any]]:
        return module.named_parameters(remove_duplicate=remove_duplicate)

    def has_forward(self, module: Any) -> bool:
        # ModuleList, ModuleDict, ParameterList, ParameterDict keep torch's placeholder forward
        return type(module).forward is not torch.nn.Module.forward

    def named_buffers(self, module: Any) -> list[tuple[str, Any]]:
        # persistent ones only: a non-persistent buffer (diffusers' RoPE tables) is in no
        # state dict and so in no checkpoint
        out = []
        for name, b in module.named_buffers():
            owner, _, leaf = name.rpartition(".")
            sub = module.get_submodule(owner) if owner else module
            if leaf not in sub._non_persistent_buffers_set:
                out.append((name, b))
        return out

    def add_hooks(self, module: Any, pre: Callable[..., Any], post: Callable[..., Any]) -> list[Any]:
        return [
            module.register_forward_pre_hook(_pre_hook_outside_graphs(pre), with_kwargs=True),
            module.register_forward_hook(_post_hook_outside_graphs(post), with_kwargs=True, always_call=True),
            module.register_state_dict_pre_hook(_refuse_sharded_state_dict),
        ]

    def move(self, module: Any, device: Any) -> None:
        # meta tensors (a model built empty, to be loaded) stay meta: the loader fills them
        module._apply(lambda t: t if t.is_meta else t.to(device))

    def place_whole(self, model: Any, params: Iterable[Any], device: Any) -> None:
        # buffers (diffusers' RoPE tables) and whole parameters go to the device the views
        # will be on; the parameters to be sharded are not moved (no whole model on the GPU)
        dev = torch.device(device)
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and not b.is_meta and b.device != dev:
                    module._buffers[name] = b.to(dev)
        for p in params:
            if not p.is_meta and p.device != dev:
                _set_data(p, p.data.to(dev))

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
        # checkpoint arrays arrive in NumPy's compute dtype (bfloat16 widened): back to p's own,
        # on p's device (a meta parameter: the target device, else the CPU)
        device = self._target if p.is_meta else p.device
        _set_data(p, torch.from_numpy(np.ascontiguousarray(array)).to(device=device or "cpu", dtype=p.dtype))

    def restore(self, p: Any, saved: Any) -> None:
        _set_data(p, saved)

    def unloaded(self, module: Any) -> list[str]:
        # buffers too: diffusers' RoPE tables are non-persistent buffers no checkpoint holds
        params = [n for n, p in module.named_parameters() if p.is_meta and not self.is_sharded(p)]
        return params + [n for n, b in module.named_buffers() if b.is_meta]

    def held_nbytes(self, params: Iterable[Any]) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    def mark_sharded(self, params: tuple[Any, ...], dtypes: tuple[DType, ...], state: str, device: str) -> None:
        # A meta (or inference) parameter takes its placeholder by torch.utils.swap_tensors,
        # which refuses a tensor with weak references: refused here before any parameter
        # changes, so that a unit is never left half sharded.
        for i, p in enumerate(params):
            if (p.is_meta or p.is_inference()) and weakref.getweakrefcount(p):
                raise RuntimeError(
                    f"cannot shard parameter {i} (shape {tuple(p.shape)}, {state.replace('sharded by hsdp in ', '')}): "
                    "it is on the meta device and something holds a weak reference to it, and torch cannot swap "
                    "data into such a tensor (torch.utils.swap_tensors); drop the weak references before sharding"
                )
        for p, dt in zip(params, dtypes):
            p._hsdp_shape = tuple(p.shape)
            _set_data(p, self._placeholder(_torch_dtype(dt), device))  # a meta parameter becomes a real one
            p._hsdp_state = state

    def _placeholder(self, dt: torch.dtype, device: str = devices.HOST) -> torch.Tensor:
        # one per dtype and device, made outside inference mode, so that a parameter is never
        # left an inference tensor (set_data shares storage, and a 0-element one is safe to
        # share); on the device the views will be, since p.data cannot change device type
        ph = self._placeholders.get((dt, device))
        if ph is None:
            # the device the views will be on: the target's (check_device), for any device
            # buffer; a device viewed as the CPU (fakedev) has CPU placeholders too
            where = self._target if device != devices.HOST and self._target is not None else torch.device("cpu")
            with torch.inference_mode(False):
                ph = self._placeholders[(dt, device)] = torch.empty(0, dtype=dt, device=where)
        return ph

    # -- dtypes and devices ----------------------------------------------------------------
    def compute_dtype(self, storage: DType) -> DType:
        return storage  # torch computes in bfloat16 and float8: no widening

    # -- exchanges: on the group's device (its table names the framework device type: NCCL's
    # "cuda") the device collectives run on the tensors themselves, ordered on torch's current
    # stream; elsewhere the group reads their bytes zero-copy.
    def permute(self, t: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        return t.permute(*axes)

    def to_float32(self, t: torch.Tensor) -> torch.Tensor:
        return t.float().contiguous()

    @outside_graphs  # a collective on the group's bytes: never traced ([Note: compile])
    def all_gather(self, group: Any, send: torch.Tensor) -> torch.Tensor:
        send = send.contiguous()
        recv = torch.empty((group.size, *send.shape), dtype=send.dtype, device=send.device)
        if _on_device(group, send):
            group.all_gather_device(send.data_ptr(), recv.data_ptr(), send.numel() * send.element_size(), _stream(send))
        else:
            group.all_gather(as_numpy(send), as_numpy(recv))
        return recv

    @outside_graphs  # a collective on the group's bytes: never traced ([Note: compile])
    def all_to_all(self, group: Any, send: torch.Tensor) -> torch.Tensor:
        send = send.contiguous()
        recv = torch.empty_like(send)
        if _on_device(group, send):
            group.all_to_all_device(send.data_ptr(), recv.data_ptr(), send.numel() * send.element_size() // group.size,
                                    _stream(send))
        else:
            group.all_to_all(as_numpy(send), as_numpy(recv))
        return recv

    def _device(self, target_device: Any) -> torch.device:
        """target_device as a torch device of a type hsdp runs on; a ValueError naming the
        value otherwise (torch's own error would not say which argument it was)."""
        try:
            device = torch.device(target_device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"target_device {target_device!r} is not a torch device; use 'cpu', 'cuda' (or 'cuda:N') or None"
            ) from None
        if not devices.backends_for(device.type):  # no backend's buffers are viewed as that type
            raise ValueError(f"target_device {target_device!r} is not supported; use 'cpu', 'cuda' or None")
        return device

    def check_device(self, target_device: Any) -> None:
        if target_device is None:
            return
        device = self._device(target_device)
        if device.type == "cuda":
            # one GPU per process: the one the NCCL backend runs on (LOCAL_RANK)
            if device.index is not None and torch.cuda.is_available() and device.index != torch.cuda.current_device():
                raise ValueError(
                    f"target_device {target_device!r}: this rank runs on cuda:{torch.cuda.current_device()} "
                    "(its LOCAL_RANK); pass 'cuda' or that device"
                )
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else device
        self._target = device

    def device_type(self, target_device: Any) -> str | None:
        return "cpu" if target_device is None else self._device(target_device).type

    # -- forwards --------------------------------------------------------------------------
    def _cast(self, obj: Any, dt: torch.dtype) -> Any:
        # The hot path of every unit's pre-forward: plain tensors and tuples first, cheaply,
        # and the same object back when nothing in it changes (then the hook returns None).
        if isinstance(obj, torch.Tensor):
            return obj.to(dt) if obj.dtype != dt and obj.is_floating_point() else obj
        kind = type(obj)
        if kind is tuple or kind is list:
            out = [self._cast(x, dt) for x in obj]
            for a, b in zip(out, obj):
                if a is not b:
                    return kind(out)
            return obj
        if kind is dict:
            new = {k: self._cast(v, dt) for k, v in obj.items()}
            for k, v in obj.items():
                if new[k] is not v:
                    return new
            return obj
        if obj is None or kind in (int, float, bool, str):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return kind(*(self._cast(x, dt) for x in obj))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            # diffusers' outputs (BaseOutput) are dataclasses
            fields = {f.name: self._cast(getattr(obj, f.name), dt) for f in dataclasses.fields(obj)}
            return dataclasses.replace(obj, **fields)
        if isinstance(obj, (tuple, list)):
            return kind(self._cast(x, dt) for x in obj)
        if isinstance(obj, dict):
            return type(obj)((k, self._cast(v, dt)) for k, v in obj.items())
        return obj

    def cast_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: DType) -> tuple[Any, Any] | None:
        dt = _TORCH_DTYPES.get(dtype) or _torch_dtype(dtype)
        # Most units get tensors already in dtype (the previous block's output): a flat look
        # settles that without rebuilding anything; one tensor and no kwargs (a chain of
        # blocks), without a call.
        if not kwargs and len(args) == 1:
            a = args[0]
            if isinstance(a, torch.Tensor) and (a.dtype == dt or not a.is_floating_point()):
                return None
        if _all_in(args, dt) and (not kwargs or _all_in(kwargs.values(), dt)):
            return None
        new_args = self._cast(args, dt)
        new_kwargs = self._cast(kwargs, dt) if kwargs else kwargs
        if new_args is args and new_kwargs is kwargs:
            return None  # torch keeps the inputs as they are
        return new_args, new_kwargs

    def cast_output(self, output: Any, dtype: DType) -> Any:
        return self._cast(output, _torch_dtype(dtype))

    # -- binding ---------------------------------------------------------------------------
    def bind(self, state: UnitState) -> None:
        views = state.adapter_data
        if views is None:
            views = state.adapter_data = _UnitViews(state, self)
        # The parameters are the only holders of the new tensors, so they hold the leases and
        # unbind returns them; views kept across binds would hold them for good.
        spec = views.host_spec
        if spec is not None and not _inference_mode():  # one import per parameter, the hot path
            to_tensor = _capsule_to_tensor
            for p, cap in zip(views.params, _C.dlpack_views(state.unit.buffers()[0], spec, _VERSIONED)):
                p.data = to_tensor(cap)
            return
        single = views.single
        if single is not None and not _inference_mode():
            typed = _from_dlpack(state.unit.buffers()[0]).view(single[0])  # a multiple of 64 bytes
            as_strided = torch.as_strided
            for p, shape, strides, offset in single[1]:
                p.data = as_strided(typed, shape, strides, offset)
            return
        for p, t in zip(views.params, self._views(views, state.unit.buffers())):
            p.data = t

    def _views(self, views: _UnitViews, bufs: tuple[Any, ...]) -> list[torch.Tensor]:
        if torch.is_inference_mode_enabled():
            # views made in inference mode would leave the parameters inference tensors for
            # as long as the unit stays unsharded (resident, say): make them normal ones.
            with torch.inference_mode(False):
                return self._views(views, bufs)
        raw = [_from_dlpack(b) if b is not None else None for b in bufs]
        typed = []
        for which, dt in views.bases:
            r = raw[which]
            extra = r.numel() % dt.itemsize  # only the converted buffer can end mid-element
            typed.append((r[: r.numel() - extra] if extra else r).view(dt))
        return [torch.as_strided(typed[base], shape, strides, offset)
                for _p, base, shape, strides, offset, _dt in views.slots]

    def unbind(self, state: UnitState) -> None:
        views = state.adapter_data
        if views is None:  # a bind that failed before its layout existed bound nothing
            return
        # the last tensor on the bind's storage goes: torch returns the lease, unless a user
        # still holds a view of a parameter (then the buffer stays out of the pool)
        for p, ph in views.placeholders:
            p.data = ph


def unsharded_reference(model: Any, param_dtype: Any = "bfloat16") -> Any:
    """Make a whole (unsharded) torch model compute what hsdp's sharded copy of it computes,
    bit for bit: the reference a ``--verify`` compares with. In place; returns the model.

    - Every parameter hsdp would shard is cast to the dtype hsdp stores it in (the same rule:
      ``param_dtype``, float32 for ``_keep_in_fp32_modules`` when ``param_dtype`` is
      narrower, nothing for float8 models or ``_hsdp_preserve_parameter_dtypes``); ignored
      modules and 0-d or integer parameters keep their own.
    - The floating inputs of the root and of every module its ``_hsdp_shard_conditions``
      select are cast to ``param_dtype``, as the units' pre-forward hooks do; a selected
      module whose parameters hsdp would all keep in float32 (``_keep_in_fp32_modules``)
      casts nothing, as its unit does not.
    """
    from ..engine.api import conditions_list, post_order
    from ..engine.policy import MixedPrecisionPolicy, keep_modules, kept, model_param_dtype, storage_dtype, unit_input_dtype

    adapter = TorchAdapter()
    policy = MixedPrecisionPolicy(param_dtype=model_param_dtype(adapter, model, param_dtype))
    if policy.param_dtype is None:
        return model
    keep = keep_modules(model)
    ignored = {id(p) for n in getattr(model, "_hsdp_ignored_modules", None) or ()
               for p in model.get_submodule(n).parameters()}
    storage = {}  # id -> the dtype hsdp stores the parameter in, for those it shards
    for name, p in model.named_parameters():
        if id(p) not in ignored and adapter.is_shardable(p):
            storage[id(p)] = storage_dtype(adapter, p, policy, kept(keep, name))
            p.data = p.data.to(_torch_dtype(storage[id(p)]))

    def hook(dtype: DType | None) -> Callable[..., Any]:
        def pre(module: Any, args: Any, kwargs: Any) -> Any:
            return adapter.cast_inputs(args, kwargs, dtype) if dtype is not None else None

        return pre

    # each selected module, children first, holds what no inner one holds (as _build_unit)
    conditions = conditions_list(getattr(model, "_hsdp_shard_conditions", None),
                                  f"{type(model).__name__}._hsdp_shard_conditions")
    claimed: set[int] = set()
    for name, module in post_order(model):
        if name and not any(c(name, module) for c in conditions):
            continue
        own = [storage[id(p)] for p in module.parameters() if id(p) in storage and id(p) not in claimed]
        claimed.update(id(p) for p in module.parameters())
        module.register_forward_pre_hook(hook(unit_input_dtype(policy, own)), with_kwargs=True)
    return model
