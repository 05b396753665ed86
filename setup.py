"""Builds the extension hsdp._C from csrc/.

The MPI backend is compiled in when an MPI compiler wrapper is found (``mpicc``, or the one
named by ``HSDP_MPICC``); without one the package still builds and ``import hsdp`` works,
and asking for MPI says what to install. ``HSDP_WERROR=1`` turns warnings into errors (CI).
``HSDP_NO_MPI=1`` forces a build without MPI.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from setuptools import Extension, setup

HERE = Path(__file__).parent
CORE = [
    "error.c", "dtype.c", "mesh.c", "layout.c", "unit.c", "checkpoint.c",
    "exec.c", "comm.c", "comm_single.c", "comm_mpi.c", "module.c",
]


def mpi_flags() -> tuple[list[str], list[str]]:
    """Compile and link flags from the MPI compiler wrapper, or ([], []) when there is none."""
    if os.environ.get("HSDP_NO_MPI") == "1":
        return [], []
    mpicc = os.environ.get("HSDP_MPICC") or shutil.which("mpicc")
    if not mpicc:
        print("hsdp: no mpicc found; building without the MPI backend", file=sys.stderr)
        return [], []
    try:
        # Open MPI spells these --showme:*, MPICH -compile_info / -link_info.
        try:
            cflags = subprocess.check_output([mpicc, "--showme:compile"], text=True, stderr=subprocess.DEVNULL)
            lflags = subprocess.check_output([mpicc, "--showme:link"], text=True, stderr=subprocess.DEVNULL)
        except subprocess.CalledProcessError:
            cflags = subprocess.check_output([mpicc, "-compile_info"], text=True).split(None, 1)[1]
            lflags = subprocess.check_output([mpicc, "-link_info"], text=True).split(None, 1)[1]
    except (OSError, subprocess.CalledProcessError, IndexError) as exc:
        print(f"hsdp: {mpicc} did not report its flags ({exc}); building without MPI", file=sys.stderr)
        return [], []
    return ["-DHSDP_HAVE_MPI", *shlex.split(cflags)], shlex.split(lflags)


mpi_c, mpi_l = mpi_flags()
# CPython's method tables cast function pointers by convention (CPython builds with this too).
cflags = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Wshadow", "-Wno-cast-function-type", *mpi_c]
if os.environ.get("HSDP_WERROR") == "1":
    cflags.append("-Werror")

setup(
    ext_modules=[
        Extension(
            "hsdp._C",
            sources=[f"csrc/{name}" for name in CORE],
            include_dirs=["csrc", np.get_include()],
            extra_compile_args=cflags,
            extra_link_args=[*mpi_l, "-ldl"],
            depends=[str(p.relative_to(HERE)) for p in (HERE / "csrc").glob("*.h")],
        )
    ]
)
