"""The default process group: which backend this process runs on, and its world group.

``backend="auto"`` means MPI when the process was started by ``mpiexec`` (Open MPI, MPICH or
any PMI/PMIx launcher), NCCL when it was started by ``torchrun`` with torch imported and a
GPU visible, and a world of one otherwise. ``backend="nccl"`` runs on GPUs under either
launcher (:mod:`hsdp.nccl` says how the ranks find each other). Nothing is initialised on import: MPI
starts on the first :func:`init_process_group` (which ``apply_hsdp_to_model`` calls for you),
and only if nobody else (mpi4py, say) has started it. hsdp finalises MPI at exit only when it
was the one that initialised it.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import TYPE_CHECKING

from .. import _C
from . import devices
from .job import launch_info, launched_by_mpi  # launched_by_mpi: public here (docs/api.md)

if TYPE_CHECKING:
    from .mesh import DeviceMesh

log = logging.getLogger("hsdp")

ProcessGroup = _C.ProcessGroup

_world: ProcessGroup | None = None
_meshes: dict[tuple[str, tuple[int, ...]], "DeviceMesh"] = {}
_atexit_registered = False
_failed = False  # an exception ended the program: peers may be waiting in a collective


def _note_failure(hook):  # type: ignore[no-untyped-def]
    """Wraps sys.excepthook: an uncaught exception means this rank must not MPI_Finalize at
    exit (finalising waits for peers that may be blocked in a collective this rank will never
    join); exiting without it makes the MPI launcher end the whole job instead."""

    def excepthook(*args):  # type: ignore[no-untyped-def]
        global _failed
        _failed = True
        return hook(*args)

    excepthook.__wrapped__ = hook  # type: ignore[attr-defined]
    return excepthook


def backends() -> dict[str, str | None]:
    """Every backend the C core registers, by name: None when it is usable here, else the
    reason it is not (what to install or build). Asking about NCCL loads its libraries
    (after importing torch) to find out whether a GPU is there."""
    return {name: _reason(name, usable, reason) for name, usable, reason in _C.backends()}


def _reason(name: str, usable: bool, reason: str | None) -> str | None:
    # a backend built but not loaded (NCCL) says only that: loading it (after torch) tells
    # whether its device is there
    mod = devices.loader(name)
    if mod is not None and not usable and mod.built():
        return mod.unusable_reason()
    return None if usable else reason


def backend_reason(name: str) -> str | None:
    """None when the named backend is usable here, else why not. Only NCCL's answer loads
    anything (torch, then its libraries)."""
    for n, usable, reason in _C.backends():
        if n == name:
            return _reason(n, usable, reason)
    raise ValueError(f"unknown backend {name!r}")


def _auto_backend() -> str:
    via = launch_info().via  # the one reading of the launcher's variables (hsdp.world.job)
    if via == "mpi":
        return "mpi"
    if via == "torchrun" and "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        return devices.device_backends_for("cuda")[0]  # the backend whose device torch's CUDA tensors view: NCCL
    world_env = os.environ.get("WORLD_SIZE")
    if world_env and world_env.isdigit() and int(world_env) > 1:
        raise RuntimeError(
            f"WORLD_SIZE={world_env} is set but this process was not started by an MPI launcher, and no GPU "
            "is visible for NCCL; hsdp's CPU backend is MPI: start the job with "
            f"`python -m hsdp.launch -n {world_env} SCRIPT` (or mpiexec -n {world_env})"
        )
    return "single"


def init_process_group(backend: str = "auto") -> ProcessGroup:
    """Initialise (once) and return the world group.

    ``backend`` is ``"auto"`` or a registered backend's name (:func:`backends`: ``"single"``,
    ``"mpi"``, ``"nccl"``). Calling it again returns the existing group;
    asking then for a different backend is an error.
    """
    global _world
    known = [name for name, _usable, _reason in _C.backends()]
    if backend != "auto" and backend not in known:
        raise ValueError(f"backend must be 'auto' or one of {', '.join(map(repr, known))}, got {backend!r}")
    if _world is not None:
        if backend not in ("auto", _world.backend):
            raise RuntimeError(
                f"the process group is already initialised with backend {_world.backend!r}; "
                f"cannot switch to {backend!r}"
            )
        return _world
    if backend == "auto":
        backend = _auto_backend()
    mod = devices.loader(backend)  # a backend whose runtime Python prepares (NCCL) starts there
    _world = mod.init_world() if mod is not None else _C.ProcessGroup(backend)
    register_teardown(multi_process=_world.backend != "single")
    log.debug("process group: backend=%s rank=%d size=%d", _world.backend, _world.rank, _world.size)
    return _world


def world_for(device_type: str | None, what: str) -> ProcessGroup:
    """The world group for buffers viewed as ``device_type`` tensors: the one rule for which
    backend a job starts on. The host's type (and None) starts "auto" (MPI under a launcher,
    else single); a device type ('cuda') starts the first backend with that device (NCCL), or
    returns the running world when it is one of them. ``what`` names the caller's value in
    the errors: no GPU here (the backend's loader picks the type), or a world already running
    on another backend (ValueError)."""
    if device_type is None or device_type == devices.host_framework():
        return init_process_group()  # a CPU target never starts a device backend
    served = devices.device_backends_for(device_type)
    if not served:
        raise ValueError(f"{what}: no backend runs on device type {device_type!r}; known: {', '.join(map(repr, devices.frameworks()))}")
    if is_initialized() and get_world_group().backend in served:
        return get_world_group()
    reason = backend_reason(served[0])  # loads NCCL (after torch): says whether a GPU is there
    if reason is not None:  # first: advice to start NCCL would only fail next
        raise devices.error_type(served[0], reason)(f"{what} needs a GPU: {reason}")
    if is_initialized():
        raise ValueError(
            f"{what} needs the {served[0].upper()} process group, but this one runs on "
            f"{get_world_group().backend!r}; call hsdp.distributed.init_process_group({served[0]!r}) first"
        )
    return init_process_group(served[0])


def world_for_device(device: str | None, what: str) -> ProcessGroup:
    """:func:`world_for` for a device as a command line writes it (``"cuda"``, ``"cuda:1"``,
    ``"cpu"``, None: the host), for ``hsdp generate`` and ``hsdp serve`` alike. Imports torch
    first where the answer may be NCCL (a device, or torchrun's variables without an MPI
    launcher), as NCCL is picked only once torch is in."""
    device_type = (device or devices.host_framework()).split(":")[0]
    if device_type != devices.host_framework() or not launched_by_mpi():
        import torch  # noqa: F401 - lazy: only commands that run torch models get here

    return world_for(device_type, what)


def register_teardown(multi_process: bool = True) -> None:
    """At exit, end the runtimes hsdp started (MPI_Finalize), unless an uncaught exception
    ended this rank of a multi-process job (see _note_failure). Once per process."""
    global _atexit_registered
    if multi_process and not hasattr(sys.excepthook, "__wrapped__"):
        sys.excepthook = _note_failure(sys.excepthook)
    if not _atexit_registered:
        atexit.register(destroy_process_group)
        _atexit_registered = True


def set_timeout(seconds: float) -> None:
    """How long a collective (a unit's first gather, a barrier, a load step, an all-to-all)
    may wait for its peers before the whole job is ended with a message saying what waited.
    0 means no limit. The default is ``HSDP_TIMEOUT`` (seconds) when set, else 600. Set it
    to the same value on every rank. Direct gathers (docs/design.md) need no peer and are
    never timed out."""
    _C.set_timeout(float(seconds))


def get_timeout() -> float:
    """The collective timeout in seconds (0: no limit)."""
    return float(_C.get_timeout())


def is_initialized() -> bool:
    return _world is not None


def get_world_group() -> ProcessGroup:
    """The world group; raises if :func:`init_process_group` has not run."""
    if _world is None:
        raise RuntimeError(
            "no hsdp process group exists; call hsdp.distributed.init_process_group() first "
            "(apply_hsdp_to_model does this itself)"
        )
    return _world


def get_rank() -> int:
    return get_world_group().rank


def get_world_size() -> int:
    return get_world_group().size


def cached_mesh(key: tuple[str, tuple[int, ...]]) -> "DeviceMesh | None":
    return _meshes.get(key)


def cache_mesh(key: tuple[str, tuple[int, ...]], mesh: "DeviceMesh") -> None:
    _meshes[key] = mesh


def destroy_process_group() -> None:
    """Drop the world group and cached meshes; finalise the backends hsdp started (MPI, when
    hsdp initialised it).

    MPI cannot be initialised twice in one process, so after this an MPI job cannot create a
    new group. It runs at interpreter exit by itself.
    """
    global _world
    _meshes.clear()
    _world = None
    if _failed:
        log.error("an uncaught exception ended this rank; leaving MPI unfinalised so the launcher ends the job")
        return
    _C.finalize_backends()
