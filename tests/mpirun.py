"""Starting real multi-rank jobs from tests: mpiexec with what this kind of machine needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hsdp.launch import plain_mpiexec_env

ROOT = Path(__file__).resolve().parent.parent

# The environment hsdp.launch gives ranks (root, oversubscription, no binding, idle yield,
# one BLAS thread per rank), for starting plain mpiexec with the same settings.
MPI_ENV = plain_mpiexec_env("openmpi", environ={})


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
