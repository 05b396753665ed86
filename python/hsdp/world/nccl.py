"""The NCCL backend's Python side: finding the libraries, and joining the ranks.

- **Libraries.** The C backend links nothing; it opens libnccl and libcudart at run time.
  The copies opened are the ones torch has loaded (read from ``/proc/self/maps`` after
  ``import torch``), else the nvidia wheels' files, else ``HSDP_NCCL_LIBRARY`` /
  ``HSDP_CUDART_LIBRARY``. Opening NCCL by its soname before torch is imported can pick a
  system NCCL that then breaks ``import torch``; that is why this happens here, after it.
- **Joining.** Rank 0 makes the NCCL unique id (128 bytes) and the others receive it: by MPI
  broadcast under ``mpiexec``, through torch's ``TCPStore`` under ``torchrun`` (the agent's
  store when torchrun serves one, else a store rank 0 serves at MASTER_ADDR:MASTER_PORT,
  or the default store of an initialised ``torch.distributed``). The id never goes over a
  socket of hsdp's own code (its only one is the MPI backend's watchdog status port,
  design.md).
  The device is LOCAL_RANK.
"""

from __future__ import annotations

import datetime
import os
import site
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import _C
from .job import Launch, launch_info  # launch_info: documented here too (hsdp.nccl.launch_info)

# The backend "nccl"'s loader (hsdp.world.devices.loader finds it by the backend's name).
HSDP_BACKEND_LOADER = True

ID_BYTES = 128

# Kept for the life of the process: the MPI world that carried the id (MPI cannot start
# twice) and the TCPStore rank 0 serves (the others may still be reading from it).
_keep: list[Any] = []
# This rank's CUDA device once joined (bind_thread sets it on other threads).
_device: list[int] = [-1]

_WHEEL_LIBS = {
    "nccl": ("nvidia/nccl/lib/libnccl.so.2",),
    "cudart": ("nvidia/cu13/lib/libcudart.so.13", "nvidia/cuda_runtime/lib/libcudart.so.12", "nvidia/cu12/lib/libcudart.so.12"),
}
_LIB_PREFIX = {"nccl": "libnccl.so", "cudart": "libcudart.so"}
_LIB_ENV = {"nccl": "HSDP_NCCL_LIBRARY", "cudart": "HSDP_CUDART_LIBRARY"}


# ---------------------------------------------------------------------------- libraries
def _site_dirs() -> list[Path]:
    dirs = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    return [Path(d) for d in dict.fromkeys(dirs) if d and Path(d).is_dir()]


def library_paths() -> tuple[str, str]:
    """(libnccl, libcudart): the copies torch loaded, else the nvidia wheels', else the
    HSDP_*_LIBRARY variables. Imports torch first."""
    import torch  # noqa: F401  (its libraries are the ones to use)

    loaded: dict[str, str] = {}
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                for kind, prefix in _LIB_PREFIX.items():
                    if kind not in loaded and Path(path).name.startswith(prefix):
                        loaded[kind] = path
    except OSError:
        pass
    out = []
    for kind in ("nccl", "cudart"):
        path = os.environ.get(_LIB_ENV[kind]) or loaded.get(kind)
        if not path:
            path = next((str(d / rel) for d in _site_dirs() for rel in _WHEEL_LIBS[kind] if (d / rel).is_file()), None)
        if not path:
            raise NotImplementedError(
                f"no {_LIB_PREFIX[kind]} was found for the NCCL backend: torch did not load one (a CPU-only torch?) "
                f"and no nvidia wheel holds one; install torch with CUDA from PyPI, or set {_LIB_ENV[kind]}"
            )
        out.append(path)
    return out[0], out[1]


# Why the backend cannot run, by the exception the C loader raised for it: NotImplementedError
# when it is not built or installed (HSDP_EUNSUPPORTED), RuntimeError when no GPU is there
# (HSDP_ENODEVICE, typed in C: as torch raises for a missing GPU). unusable_reason() records
# each reason it returns, so error_type() reads the type, never the text.
_REASON_TYPES: dict[str, type[Exception]] = {}


def error_type(reason: str) -> type[Exception]:
    """The exception type for a reason the NCCL backend cannot run (one unusable_reason()
    returned): the type the C core raised for it, NotImplementedError for any other."""
    return _REASON_TYPES.get(reason, NotImplementedError)


def built() -> bool:
    """Whether this build has the NCCL backend (every build unless HSDP_NO_NCCL=1)."""
    return bool(_C.nccl_built())


def load() -> None:
    """Opens libnccl and libcudart (once) and checks that a GPU is there. On a machine with
    no GPU this raises RuntimeError at once, with the CUDA runtime's error; nothing stays
    loaded and torch is unaffected. A backend not built, or libraries not found, raise
    NotImplementedError."""
    if not _C.nccl_built():
        _C.nccl_load("", "")  # raises the build's own reason
    if _C.nccl_version():
        return
    _C.nccl_load(*library_paths())  # RuntimeError when no GPU is there (typed in C)


def unusable_reason() -> str | None:
    """None when the NCCL backend can run here, else why not (loads it to find out)."""
    try:
        load()
    except (NotImplementedError, RuntimeError, ValueError, OSError, ImportError) as exc:
        _REASON_TYPES[str(exc)] = RuntimeError if type(exc) is RuntimeError else NotImplementedError
        return str(exc)
    return None


# ------------------------------------------------------------------- the float8 wire's kernel
# On NCCL the float8 wire (HSDPInferenceConfig.wire_dtype) is dequantized on the GPU by a kernel
# NVRTC compiles at first use and the CUDA driver launches (csrc/cuda_dequant.c). NVRTC ships
# in the nvidia wheels CUDA builds of torch depend on; the driver comes with the NVIDIA driver.
_NVRTC_WHEELS = ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "nvidia/cu12/lib/libnvrtc.so.12")
_NVRTC_ENV, _DRIVER_ENV = "HSDP_NVRTC_LIBRARY", "HSDP_CUDA_DRIVER_LIBRARY"


def wire_kernel_paths() -> tuple[str, str]:
    """(libnvrtc, libcuda): HSDP_NVRTC_LIBRARY, else the copy already mapped (torch's), else the
    nvidia wheels'; HSDP_CUDA_DRIVER_LIBRARY, else the driver by its soname."""
    nvrtc = os.environ.get(_NVRTC_ENV)
    if not nvrtc:
        try:
            with open("/proc/self/maps") as maps:
                nvrtc = next((p for line in maps if "/" in line
                              for p in [line.rsplit(None, 1)[-1]] if Path(p).name.startswith("libnvrtc.so")), None)
        except OSError:
            nvrtc = None
    if not nvrtc:
        nvrtc = next((str(d / rel) for d in _site_dirs() for rel in _NVRTC_WHEELS if (d / rel).is_file()), None)
    if not nvrtc:
        raise NotImplementedError(
            "wire_dtype='float8_e4m3fn' on NCCL dequantizes with a kernel compiled by NVRTC, and no libnvrtc was "
            f"found (install the nvidia-cuda-nvrtc wheel that CUDA builds of torch bring, or set {_NVRTC_ENV}); "
            "use wire_dtype=None on the GPU otherwise"
        )
    return nvrtc, os.environ.get(_DRIVER_ENV) or "libcuda.so.1"


def load_wire_kernel() -> None:
    """Opens NVRTC and the CUDA driver for the float8 wire's kernel (once; the kernel is compiled
    for the GPU at the first float8 gather). A missing library raises NotImplementedError
    naming it; bfloat16 gathers never need this."""
    if _C.wire_cuda_loaded():
        return
    _C.wire_cuda_load(*wire_kernel_paths())


# ---------------------------------------------------------------------------- the unique id
def _check_id(uid: bytes, where: str) -> bytes:
    if len(uid) != ID_BYTES:
        raise RuntimeError(f"the NCCL unique id from {where} is {len(uid)} bytes, not {ID_BYTES}")
    return uid


def exchange_over_mpi(make_id: Callable[[], bytes]) -> tuple[bytes, int, int]:
    """(id, rank, size): rank 0 of the MPI world makes the id, an MPI broadcast carries it."""
    from .distributed import register_teardown

    world = _C.ProcessGroup("mpi")
    _keep.append(world)
    register_teardown()  # hsdp started MPI here: it finalises it at exit
    buf = np.zeros(ID_BYTES, np.uint8)
    if world.rank == 0:
        buf[:] = np.frombuffer(_check_id(make_id(), "ncclGetUniqueId"), np.uint8)
    world.broadcast(buf, 0)
    return buf.tobytes(), world.rank, world.size


def _store(info: Launch, timeout_s: float) -> Any:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    limit = timeout_s if timeout_s > 0 else 86400.0 * 365
    timeout = datetime.timedelta(seconds=limit)
    if not info.agent_store and info.rank == 0:
        try:
            return dist.TCPStore(info.master_addr, info.master_port, info.size, is_master=True, timeout=timeout,
                                 wait_for_workers=False)
        except Exception as exc:  # torch raises its own store errors (DistNetworkError, ...)
            raise RuntimeError(f"rank 0: could not serve the TCPStore at {info.master_addr}:{info.master_port} "
                               f"(MASTER_ADDR:MASTER_PORT): {exc}") from exc
    # A client that comes up before the server is refused, and torch's own retry then backs
    # off for most of its timeout: short attempts instead, until the whole timeout is spent.
    deadline = time.monotonic() + limit
    while True:
        left = deadline - time.monotonic()
        try:
            store = dist.TCPStore(info.master_addr, info.master_port, is_master=False,
                                  timeout=datetime.timedelta(seconds=max(min(left, 2.0), 0.1)))
            store.set_timeout(timeout)
            return store
        except Exception as exc:
            if left <= 0:
                raise RuntimeError(f"rank {info.rank}: could not reach the TCPStore at {info.master_addr}:"
                                   f"{info.master_port} (MASTER_ADDR:MASTER_PORT) within {limit:g} s: {exc}") from exc
            time.sleep(0.05)


def exchange_over_store(make_id: Callable[[], bytes], info: Launch, timeout_s: float) -> bytes:
    """Rank 0 sets the id in torch's TCPStore; every rank reads it (within timeout_s)."""
    store = _store(info, timeout_s)
    _keep.append(store)
    key = f"hsdp/nccl_unique_id/{info.restart}"
    if info.rank == 0:
        store.set(key, _check_id(make_id(), "ncclGetUniqueId"))
    try:
        uid = store.get(key)
    except Exception as exc:
        raise RuntimeError(
            f"rank {info.rank}: rank 0 did not publish the NCCL unique id at {info.master_addr}:{info.master_port} "
            f"within {timeout_s:g} s (HSDP_TIMEOUT): {exc}"
        ) from exc
    uid = _check_id(bytes(uid), f"the TCPStore at {info.master_addr}:{info.master_port}")
    # Rank 0 may be the store's server: it waits until every rank has read the id, so that
    # the store outlives every read, and names the ranks that never came.
    store.set(f"{key}/read/{info.rank}", b"1")
    if info.rank == 0 and not info.agent_store:
        keys = [f"{key}/read/{r}" for r in range(info.size)]
        deadline = time.monotonic() + (timeout_s if timeout_s > 0 else 86400.0 * 365)
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise RuntimeError(
                    f"rank 0: ranks {missing} of {info.size} did not read the NCCL unique id from the TCPStore at "
                    f"{info.master_addr}:{info.master_port} within {timeout_s:g} s (HSDP_TIMEOUT)"
                )
            time.sleep(0.01)
    return uid


def exchange_unique_id(make_id: Callable[[], bytes], info: Launch, timeout_s: float) -> tuple[bytes, int, int]:
    """(id, rank, size) by the launcher's own means; make_id runs on rank 0 only."""
    if info.via == "mpi":
        return exchange_over_mpi(make_id)
    if info.via == "torchrun":
        return exchange_over_store(make_id, info, timeout_s), info.rank, info.size
    return _check_id(make_id(), "ncclGetUniqueId"), 0, 1


def host_reads() -> bool:
    """Whether the loaded CUDA runtime's device memory is host memory the host reads (the test
    fake under FAKE_HOST_VIEW=1, csrc/tests/fake_cuda_nccl.c): the backend then views its
    buffers as the CPU, and a CPU-only torch computes on them with no stream."""
    from .devices import host_framework, of_backend

    return of_backend("nccl").framework == host_framework()


def join(uid: bytes, rank: int, size: int, local: int) -> Any:
    """Joins the NCCL world of ``uid`` as ``rank`` of ``size`` on CUDA device ``local`` (the
    libraries loaded, the id exchanged) and returns its group. Over a runtime whose memory
    the host reads, torch is not asked for a GPU or a stream: it computes on the CPU."""
    if host_reads():
        _C.nccl_bootstrap(uid, rank, size, local)
        return _C.ProcessGroup("nccl")
    import torch

    count = torch.cuda.device_count()
    if local >= count and count == 1:
        # A launcher that gives each rank its own GPU (SLURM --gpus-per-task=1, Kubernetes)
        # sets CUDA_VISIBLE_DEVICES per rank: the rank's GPU is device 0, whatever LOCAL_RANK says.
        local = 0
    if local >= count:
        raise ValueError(
            f"rank {rank}: LOCAL_RANK {local} has no GPU: this machine shows {count} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); run at most {count} ranks per host"
        )
    torch.cuda.set_device(local)
    _device[0] = local
    # hsdp's device buffers come from cudaMalloc, beside torch's caching allocator: when one
    # runs out of memory, torch gives back what it caches and the allocation is retried once
    _C.nccl_set_oom_handler(torch.cuda.empty_cache)
    _C.nccl_bootstrap(uid, rank, size, local)
    # torch computes on its current stream; the gathers make that stream wait, not the host
    _C.nccl_set_stream(torch.cuda.current_stream().cuda_stream)
    return _C.ProcessGroup("nccl")


def init_world() -> Any:
    """The NCCL world group: load, pick the device (LOCAL_RANK), exchange the id, join."""
    load()
    import torch

    info = launch_info()
    uid, rank, size = exchange_unique_id(_C.nccl_unique_id, info, float(_C.get_timeout()))
    if info.local_rank >= 0:
        local = info.local_rank
    else:  # one GPU per rank; over host memory, the runtime's first device
        local = 0 if host_reads() else rank % max(torch.cuda.device_count(), 1)
    return join(uid, rank, size, local)


def set_compute_stream(stream: Any) -> None:
    """Tell hsdp which CUDA stream the model runs on (a ``torch.cuda.Stream``), when it is not
    the one that was current at ``init_process_group``: gathers make that stream wait."""
    _C.nccl_set_stream(int(getattr(stream, "cuda_stream", stream)))


def bind_thread() -> None:
    """Makes the calling thread use this rank's GPU. A thread's CUDA device is its own and
    starts at device 0: torch in a thread you start yourself (a server's worker, a data
    loader's) would make a context on GPU 0 from every rank of a host, and mix devices. hsdp's
    own calls set it themselves; call this first in any thread that runs torch on the GPU.
    Does nothing before the NCCL world exists, or over a runtime whose memory the host reads."""
    if _device[0] < 0 or host_reads():
        return
    import torch

    torch.cuda.set_device(_device[0])


def stream_probe() -> Callable[[], int] | None:
    """A function returning torch's current CUDA stream on this rank's GPU (its raw handle;
    0 for the legacy default stream), for a schedule to read at each forward's start; None
    over a runtime whose memory the host reads (no streams: torch computes on the CPU)."""
    if host_reads():
        return None
    import torch

    device = torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # older torch: the public route, a few microseconds more per forward
        return lambda: int(torch.cuda.current_stream(device).cuda_stream)
    return lambda: int(raw(device))


def comm_stream() -> Any:
    """The side stream gathers run on, as a ``torch.cuda.ExternalStream`` (for timing)."""
    import torch

    return torch.cuda.ExternalStream(_C.nccl_comm_stream())
