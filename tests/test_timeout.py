"""HSDP_TIMEOUT: a collective that waits longer for a stalled peer ends the job on every rank,
saying what waited, instead of hanging (docs/launching.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mpirun import MPI_ENV, ROOT, mpiexec

import hsdp


@pytest.mark.parametrize("where,what", [("forward", "the first gather of unit"), ("barrier", "MPI_Barrier")])
def test_a_stalled_peer_ends_the_job_within_the_timeout(where, what):
    env = {**os.environ, **MPI_ENV, "HSDP_TIMEOUT": "2"}
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "hsdp._rank", "tests/timeout_worker.py", where]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert "has waited more than 2 s (HSDP_TIMEOUT)" in proc.stderr, proc.stderr
    assert what in proc.stderr and "rank 0:" in proc.stderr
    assert "not in it: rank 1 (in no collective)" in proc.stderr, proc.stderr  # who did not arrive
    assert "not reached" not in proc.stdout
    assert took < 2 + 10 + 10, took  # the timeout, plus start-up, plus the launcher's teardown
    print(f"job ended {took:.1f} s after launch")


def test_a_peer_in_another_collective_is_named_with_it():
    """Rank 1 waits in a barrier while rank 0 waits in the first gather: the watchdog that
    fires names the other rank and the collective it waits in instead."""
    env = {**os.environ, **MPI_ENV, "HSDP_TIMEOUT": "2"}
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "hsdp._rank", "tests/timeout_worker.py", "elsewhere"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode != 0
    named = ("not in it: rank 1 (waiting in MPI_Barrier" in proc.stderr
             or "not in it: rank 0 (waiting in MPI_Isend/MPI_Irecv (a gather, tickets beside the data)" in proc.stderr)
    assert named, proc.stderr


def test_a_killed_peer_ends_the_job():
    """Rank 1 dies by SIGKILL before a gather rank 0 waits in: the launcher ends the job (no
    timeout needed: mpiexec sees the death), and rank 0 never returns from the gather."""
    env = {**os.environ, **MPI_ENV, "HSDP_TIMEOUT": "60"}
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "hsdp._rank", "tests/timeout_worker.py", "kill"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert "not reached" not in proc.stdout
    assert took < 30, took  # well within the 60 s timeout: the launcher, not the watchdog, ended it
    print(f"job ended {took:.1f} s after launch")


def test_the_timeout_setting_is_checked():
    before = hsdp.distributed.get_timeout()
    try:
        hsdp.distributed.set_timeout(0)
        assert hsdp.distributed.get_timeout() == 0.0
        with pytest.raises(ValueError, match="seconds >= 0"):
            hsdp.distributed.set_timeout(-1)
    finally:
        hsdp.distributed.set_timeout(before)
