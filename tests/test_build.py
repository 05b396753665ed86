"""Builds with and without MPI coexist in one checkout: switching rebuilds the extension with
the new flags (no manual clean), and a build of an unchanged variant compiles nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from mpirun import ROOT


def _copy_sources(dst: Path) -> None:
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    shutil.copytree(ROOT / "csrc", dst / "csrc", ignore=shutil.ignore_patterns("bin", "*.o"))
    shutil.copytree(ROOT / "python", dst / "python", ignore=shutil.ignore_patterns("*.so", "__pycache__"))


def _build(where: Path, no_mpi: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "HSDP_NO_MPI"}
    if no_mpi:
        env["HSDP_NO_MPI"] = "1"
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=where, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _mpi_usable(where: Path) -> bool:
    code = "import hsdp._C as C; print(dict((n, u) for n, u, _ in C.backends())['mpi'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=where, env={**os.environ, "PYTHONPATH": "python"},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return out.strip() == "True"


def test_switching_mpi_and_no_mpi_builds_needs_no_clean(tmp_path: Path) -> None:
    _copy_sources(tmp_path)
    _build(tmp_path, no_mpi=True)
    assert not _mpi_usable(tmp_path)
    _build(tmp_path, no_mpi=False)  # the flags changed: a real rebuild, not "up to date"
    assert _mpi_usable(tmp_path)
    again = _build(tmp_path, no_mpi=False)
    assert " -c csrc/" not in again  # same variant: nothing recompiled
    # the NCCL backend is in both variants when its headers are found (torch's nvidia wheels)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "csrc"))
    from cuda_headers import include_dirs

    suffix = "-nccl" if include_dirs() else ""
    assert sorted(p.name for p in tmp_path.glob("build/temp*/*") if p.is_dir()) == ["mpi" + suffix, "nompi" + suffix]
