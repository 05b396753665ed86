"""HSDP_TIMEOUT: a collective that waits longer for a stalled peer ends the job on every rank,
saying what waited, instead of hanging; that covers the end of the job too, after which
nothing of it is left (docs/launching.md, docs/reliability.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mpirun import MPI_ENV, ROOT, assert_nothing_left, mpiexec, run_watched

import hsdp


TIMEOUT_S = 2
# Past HSDP_TIMEOUT, what ending the job may take: the watchdog's 0.1 s tick, asking the
# peers what they wait in, MPI_Abort, and the launcher's teardown of every rank.
END_S = 5


@pytest.mark.parametrize("where,what", [("forward", "the first gather of unit"), ("barrier", "MPI_Barrier")])
def test_a_stalled_peer_ends_the_job_within_the_timeout(where, what):
    """Measured from when rank 0 is ready (it then enters the collective): the job ends no
    sooner than HSDP_TIMEOUT and within END_S after it, and says what waited and who did not
    come. A watchdog that never fires fails here within the bound, not at a generic limit."""
    env = {**os.environ, **MPI_ENV, "HSDP_TIMEOUT": str(TIMEOUT_S)}
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "hsdp._rank", "tests/timeout_worker.py", where]
    # Start-up (unbounded here: a loaded machine) is left out of the bound, not of the limit.
    run = run_watched(cmd, env, limit=60, watch=("rank 0: ready",))
    waited = run.after("rank 0: ready")
    assert run.returncode != 0
    assert "rank 0: MPI_" in run.output, run.output
    assert f"has waited more than {TIMEOUT_S} s (HSDP_TIMEOUT)" in run.output, run.output
    assert what in run.output
    assert "not in it: rank 1 (in no collective)" in run.output, run.output  # who did not arrive
    assert ": not reached" not in run.output
    assert TIMEOUT_S - 0.5 <= waited <= TIMEOUT_S + END_S, f"ended {waited:.1f} s after rank 0 was ready"
    print(f"job ended {waited:.1f} s after rank 0 was ready, {run.ended - run.started:.1f} s after launch")


def test_a_peer_stalled_after_warm_up_ends_the_job_at_exit():
    """After a warm-up forward every gather is a direct read, so rank 0 finishes its second
    forward alone while rank 1 stalls. Its exit meets the peer (MPI's end is collective):
    HSDP_TIMEOUT covers that wait too, naming rank 1, and the launcher leaves nothing."""
    limit = 5
    env = {**os.environ, "HSDP_TIMEOUT": str(limit)}
    cmd = [sys.executable, "-m", "hsdp.launch", "-n", "2", "tests/timeout_worker.py", "after"]
    run = run_watched(cmd, env, limit=90, watch=("rank 0: done",))
    waited = run.after("rank 0: done")
    assert run.returncode != 0
    assert ("rank 0: MPI_Barrier of 0 bytes over a group of 2 ranks (finalising: every rank ends MPI together) "
            f"has waited more than {limit} s (HSDP_TIMEOUT)") in run.output, run.output
    assert "not in it: rank 1 (in no collective)" in run.output, run.output
    assert limit - 0.5 <= waited <= limit + END_S, f"ended {waited:.1f} s after rank 0 finished"
    assert_nothing_left(run)
    print(f"job ended {waited:.1f} s after rank 0 finished, {run.ended - run.started:.1f} s after launch")


def test_a_peer_in_another_collective_is_named_with_it():
    """Rank 1 waits in a barrier while rank 0 waits in the first gather: the watchdog that
    fires names the other rank and the collective it waits in instead."""
    env = {**os.environ, **MPI_ENV, "HSDP_TIMEOUT": str(TIMEOUT_S)}
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "hsdp._rank", "tests/timeout_worker.py", "elsewhere"]
    run = run_watched(cmd, env, limit=60, watch=("rank 0: ready",))
    assert run.returncode != 0
    named = ("not in it: rank 1 (waiting in MPI_Barrier" in run.output
             or "not in it: rank 0 (waiting in MPI_Isend/MPI_Irecv (a gather, tickets beside the data)" in run.output)
    assert named, run.output
    assert run.after("rank 0: ready") <= TIMEOUT_S + END_S, run.output


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
