"""Builds the extension hsdp._C from csrc/.

The MPI backend is compiled in when an MPI compiler wrapper is found (``mpicc``, or the one
named by ``HSDP_MPICC``); without one the package still builds and ``import hsdp`` works,
and asking for MPI says what to install. ``HSDP_WERROR=1`` turns warnings into errors (CI).
``HSDP_NO_MPI=1`` forces a build without MPI. The NCCL backend is in every build: it needs
no CUDA toolkit and no NCCL or CUDA header (csrc/cuda_abi.h declares what it uses), links
nothing, and opens both libraries at run time, so a machine without a GPU fails only when
NCCL is asked for. ``HSDP_NO_NCCL=1`` forces a build without it. ``HSDP_TEST_BACKENDS=1``
(``make build``) adds the test-only ``fakedev`` backend; a wheel is built without it.
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
from setuptools.command.build_ext import build_ext


def _env_flag(name: str) -> bool:
    """An HSDP_* build flag by hsdp's one rule for flags (hsdp.world.flags.env_flag, loaded from
    its file: the package is not importable before it is built)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_hsdp_flags", Path(__file__).parent / "python/hsdp/world/flags.py")
    flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags)
    return flags.env_flag(name, False)


HERE = Path(__file__).parent


def sources(path: Path = HERE / "csrc" / "sources.mk") -> dict[str, list[str]]:
    """The source lists of csrc/sources.mk (``NAME := a.c b.c``, lines continued with ``\\``),
    which the Makefile includes too."""
    lists: dict[str, list[str]] = {}
    text = path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        if ":=" in line:
            name, _, value = line.partition(":=")
            lists[name.strip()] = value.split()
    return lists


def variant(compile_args: list[str]) -> str:
    """A name for the build's flags, so builds with and without MPI (or, forced off, NCCL) keep
    their object files apart (setuptools would otherwise reuse objects compiled with the other
    flags)."""
    name = "mpi" if "-DHSDP_HAVE_MPI" in compile_args else "nompi"
    name += "-nonccl" if "-DHSDP_NO_NCCL" in compile_args else ""
    return name + ("-tests" if "-DHSDP_TEST_BACKENDS" in compile_args else "")


class VariantBuildExt(build_ext):
    """Object files go to build_temp/<variant>, and a build whose variant differs from the
    last one is forced: setuptools would otherwise call the extension up to date and keep
    the one compiled with the other flags."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self._stamp = Path(self.build_temp) / "variant"
        self.build_temp = os.path.join(self.build_temp, variant(cflags))

    def run(self) -> None:
        now = variant(cflags)
        last = self._stamp.read_text() if self._stamp.exists() else None
        if last != now:
            self.force = True
        super().run()
        self._stamp.parent.mkdir(parents=True, exist_ok=True)
        self._stamp.write_text(now)


def mpi_flags() -> tuple[list[str], list[str]]:
    """Compile and link flags from the MPI compiler wrapper, or ([], []) when there is none."""
    if _env_flag("HSDP_NO_MPI"):
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


def nccl_flags() -> list[str]:
    """[] (the NCCL backend is built), or -DHSDP_NO_NCCL when HSDP_NO_NCCL=1 forces it off."""
    if _env_flag("HSDP_NO_NCCL"):
        print("hsdp: HSDP_NO_NCCL=1: building without the NCCL backend", file=sys.stderr)
        return ["-DHSDP_NO_NCCL"]
    return []


SRC = sources()
mpi_c, mpi_l = mpi_flags()
# CPython's method tables cast function pointers by convention (CPython builds with this too).
# HSDP_TEST_BACKENDS=1 (`make build`) adds the test-only fakedev backend (sources.mk's TEST_SRC);
# a wheel has none. The define marks the variant only: the registry finds the backend by its symbol.
TESTS = _env_flag("HSDP_TEST_BACKENDS")
cflags = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Wshadow", "-Wno-cast-function-type", *mpi_c, *nccl_flags(),
          *(["-DHSDP_TEST_BACKENDS"] if TESTS else [])]
if _env_flag("HSDP_WERROR"):
    cflags.append("-Werror")

setup(
    ext_modules=[
        Extension(
            "hsdp._C",
            sources=[*SRC["CORE_SRC"], *SRC["WRAP_SRC"], *(SRC["TEST_SRC"] if TESTS else [])],
            include_dirs=["csrc", np.get_include()],
            extra_compile_args=cflags,
            extra_link_args=[*mpi_l, "-ldl"],
            depends=[str(p.relative_to(HERE)) for ext in ("*.h", "*.def") for p in (HERE / "csrc").rglob(ext)],
        )
    ],
    cmdclass={"build_ext": VariantBuildExt},
)
