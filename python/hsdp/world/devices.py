"""Where a backend's unsharded buffers live, asked of the C core's device tables.

A backend either keeps its buffers in host memory (single, MPI) or has a device (NCCL: CUDA;
the test-only ``fakedev``: host memory that claims to be a device). The rest of the Python
side asks this module instead of naming backends: which framework device type a backend's
buffers are viewed as (``"cuda"``), which backend serves a device type, and where a unit's
buffers go for a target device. See docs/design.md, [Note: the device contract].

No backend is named here. A backend whose runtime Python prepares before its world can start
has a loader: the module of its name in this package (``hsdp.world.nccl`` for "nccl"), found
by that name; the backends themselves are C's registry (csrc/backends.def).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .. import _C

HOST = "host"

# A loader (libraries found beside torch, a unique id handed around, before the C world can
# start) provides built(), unusable_reason(), error_type(reason) and init_world(), and
# load_wire_kernel() when its device decodes the float8 wire itself; it says so with this
# marker, so a module of this package that shares a backend's name by chance is not taken.
LOADER_MARK = "HSDP_BACKEND_LOADER"


@dataclass(frozen=True)
class DeviceInfo:
    """A backend's device, as C describes it (``_C.device_info``)."""

    backend: str
    kind: str  # "host" or "device"
    device: str  # "host", or the device's name: what Unit(device=) and _Buffer.device say
    framework: str  # the framework device type views of its buffers have: "cpu", "cuda"
    dlpack: tuple[int, int]  # (DLPack device type, id) its buffers are exported as

    @property
    def on_device(self) -> bool:
        return self.kind == "device"


def _info(d: dict[str, Any]) -> DeviceInfo:
    return DeviceInfo(d["backend"], d["kind"], d["device"], d["framework"], tuple(d["dlpack"]))


def of_backend(name: str) -> DeviceInfo:
    """The named backend's device (ValueError for an unknown name)."""
    return _info(_C.device_info(name))


_OF_LOADED: dict[str, DeviceInfo] = {}


def of_group(group: Any) -> DeviceInfo:
    """The device of a process group's backend. Asked on every exchange, so it is read from C
    once per backend: a group exists only once its backend is loaded, and from then on the
    backend's device does not change."""
    info = _OF_LOADED.get(group.backend)
    if info is None:
        info = _OF_LOADED[group.backend] = _info(group.device_info)
    return info


def host_framework() -> str:
    """The framework device type host memory is viewed as ("cpu")."""
    return of_backend("single").framework


def backends_for(framework: str) -> list[str]:
    """The registered backends whose buffers are viewed as ``framework`` device tensors, in
    registry order (for ``"cpu"``: the host backends and any device viewed as the CPU)."""
    return [name for name, _usable, _why in _C.backends() if of_backend(name).framework == framework]


def frameworks() -> list[str]:
    """The framework device types some registered backend's buffers are viewed as, sorted."""
    return sorted({of_backend(name).framework for name, _usable, _why in _C.backends()})


def device_backends_for(framework: str) -> list[str]:
    """The backends with a device viewed as ``framework`` tensors (``"cuda"``: NCCL)."""
    return [n for n in backends_for(framework) if of_backend(n).on_device]


def framework_of(device: str) -> str:
    """The framework device type of buffers on ``device`` ('host' or a device's name)."""
    if device == HOST:
        return host_framework()
    for name, _usable, _why in _C.backends():
        info = of_backend(name)
        if info.on_device and info.device == device:
            return info.framework
    raise ValueError(f"unknown device {device!r}")


def buffer_device(group: Any, framework: str | None, target_device: Any) -> str:
    """Where a unit's buffers live: on the group's device when ``target_device`` is given and
    its framework device type (``framework``; None: the adapter binds host memory only) is
    the one the device is viewed as; host memory otherwise."""
    info = of_group(group)
    if target_device is not None and framework is not None and info.on_device and info.framework == framework:
        return info.device
    return HOST


@functools.cache
def _registered() -> frozenset[str]:
    """The backends C registers (csrc/backends.def): fixed for the life of the extension."""
    return frozenset(b[0] for b in _C.backends())


def loader(name: str) -> ModuleType | None:
    """The module that prepares the named backend's runtime (``hsdp.world.<name>``), or None
    when C alone starts it."""
    if name not in _registered():
        return None
    module = f"{__package__}.{name}"
    if importlib.util.find_spec(module) is None:
        return None
    mod = importlib.import_module(module)
    return mod if getattr(mod, LOADER_MARK, False) else None


def error_type(name: str, reason: str) -> type[Exception]:
    """The exception for a reason the named backend cannot run: its loader's choice
    (RuntimeError when a device is missing), else NotImplementedError (not built)."""
    mod = loader(name)
    return mod.error_type(reason) if mod else NotImplementedError


def prepare_wire(group: Any) -> None:
    """Readies the float8 wire's decode into the group's device buffers: the backend's loader
    loads what its device needs (NCCL: the kernel, through NVRTC and the CUDA driver; a
    missing library is a NotImplementedError naming it). A device without a decoder of its
    own raises NotImplementedError."""
    info = of_group(group)
    mod = loader(info.backend)
    load = getattr(mod, "load_wire_kernel", None) if mod else None
    if load is None:
        raise NotImplementedError(
            f"wire_dtype on device {info.device!r} ({info.backend}) is not built: its dequantization after each "
            "gather is a host loop, and this device has no decoder of its own. Use wire_dtype=None there"
        )
    load()
