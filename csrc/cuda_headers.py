"""Where the NCCL and CUDA runtime headers are, for building the NCCL backend.

The backend opens libnccl and libcudart at run time, so only the headers are needed to build
it, for their types. They are looked for in ``HSDP_CUDA_HOME/include``, then in the nvidia
wheels torch brings (``nvidia/nccl/include``, ``nvidia/cu13/include`` or
``nvidia/cuda_runtime/include``), then in ``/usr/local/cuda/include``. ``HSDP_NO_NCCL=1``
builds without the backend. Used by setup.py and, as a script printing compiler flags, by
the Makefile's C tests.
"""

from __future__ import annotations

import os
import site
import sys
from pathlib import Path

_RUNTIME_DIRS = ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cu12/include")


def _site_dirs() -> list[Path]:
    dirs = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    return [Path(d) for d in dict.fromkeys(dirs) if d and Path(d).is_dir()]


def include_dirs() -> list[str] | None:
    """The directories holding nccl.h and cuda_runtime_api.h, or None when either is missing."""
    if os.environ.get("HSDP_NO_NCCL") == "1":
        return None
    nccl: Path | None = None
    runtime: Path | None = None
    home = os.environ.get("HSDP_CUDA_HOME")
    candidates: list[tuple[Path, Path]] = []
    if home:
        candidates.append((Path(home) / "include", Path(home) / "include"))
    for d in _site_dirs():
        for r in _RUNTIME_DIRS:
            candidates.append((d / "nvidia/nccl/include", d / r))
    candidates.append((Path("/usr/local/cuda/include"), Path("/usr/local/cuda/include")))
    for n, r in candidates:
        if nccl is None and (n / "nccl.h").is_file():
            nccl = n
        if runtime is None and (r / "cuda_runtime_api.h").is_file():
            runtime = r
    if nccl is None or runtime is None:
        return None
    return list(dict.fromkeys([str(nccl), str(runtime)]))


if __name__ == "__main__":
    found = include_dirs()
    print(" ".join(["-DHSDP_HAVE_NCCL", *(f"-isystem {d}" for d in found)]) if found else "")
