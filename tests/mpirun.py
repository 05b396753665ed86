"""Starting real multi-rank jobs from tests: mpiexec with what this kind of machine needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    # unbound, so each rank's collective worker thread can run beside its compute
    "OMPI_MCA_hwloc_base_binding_policy": "none",
    "PYTHONUNBUFFERED": "1",
    # One BLAS thread per rank: ranks already share the cores.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}


def mpiexec() -> str:
    exe = shutil.which("mpiexec")
    if exe is None:
        pytest.fail("mpiexec is not installed; `make test` installs Open MPI (apt-get install openmpi-bin)")
    return exe


def run_ranks(n: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs `python ARGS...` on n ranks; fails the test with the output if any rank fails."""
    env = {**os.environ, **MPI_ENV}
    cmd = [mpiexec(), "-n", str(n), sys.executable, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc
