"""Where the real NCCL and CUDA runtime headers are, for checking csrc/cuda_abi.h against them.

The build needs neither header: the NCCL backend is compiled against csrc/cuda_abi.h, our
own declarations of the few types, values and functions it uses. This finds the real headers
for the one check that compares the two (csrc/tests/test_cuda_abi.c, run by ``make ctest``):
in ``HSDP_CUDA_HOME/include``, then in the nvidia wheels torch brings
(``nvidia/nccl/include``, ``nvidia/cu13/include`` or ``nvidia/cuda_runtime/include``), then
in ``/usr/local/cuda/include``. As a script it prints the compiler flags of each installation
found, one line each (nothing when there is none).
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


def _candidates() -> list[list[tuple[Path, Path]]]:
    """(nccl.h dir, cuda_runtime_api.h dir) candidates, in groups that belong together."""
    groups: list[list[tuple[Path, Path]]] = []
    home = os.environ.get("HSDP_CUDA_HOME")
    if home:
        groups.append([(Path(home) / "include", Path(home) / "include")])
    groups.append([(d / "nvidia/nccl/include", d / r) for d in _site_dirs() for r in _RUNTIME_DIRS])
    groups.append([(Path("/usr/local/cuda/include"), Path("/usr/local/cuda/include"))])
    return groups


def _first(candidates: list[tuple[Path, Path]]) -> list[str] | None:
    nccl = next((n for n, _ in candidates if (n / "nccl.h").is_file()), None)
    runtime = next((r for _, r in candidates if (r / "cuda_runtime_api.h").is_file()), None)
    if nccl is None or runtime is None:
        return None
    return list(dict.fromkeys([str(nccl), str(runtime)]))


def all_include_dirs() -> list[list[str]]:
    """Every installation of the two headers found (HSDP_CUDA_HOME, torch's nvidia wheels,
    /usr/local/cuda), each as its include directories; the check runs against each."""
    found = [_first(group) for group in _candidates()]
    return list({tuple(f): f for f in found if f}.values())


if __name__ == "__main__":  # one line of compiler flags per installation
    for dirs in all_include_dirs():
        print(" ".join(f"-isystem {d}" for d in dirs))
