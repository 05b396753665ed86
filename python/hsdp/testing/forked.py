"""Worlds of forked ranks for the fake CUDA/NCCL library (csrc/tests/fake_cuda_nccl.c), whose
ranks share the region made with the unique id: forked from the process that made it, they
inherit it. Used by tests/nccl_torch_fake.py and bench/gpu_check_multi.py --dry-run."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable


def fork_ranks(n: int, rank_main: Callable[[int], None], limit_s: float) -> tuple[dict[int, int], list[int]]:
    """Forks n ranks, each running ``rank_main(rank)`` (which must end the child with
    ``os._exit``), and reaps them: (exit status by rank, the ranks still running after
    ``limit_s`` seconds, killed: a hang)."""
    sys.stdout.flush(), sys.stderr.flush()  # a child must not write the parent's buffered lines again
    pids = []
    for r in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                rank_main(r)
            finally:
                os._exit(1)  # rank_main returned or raised without ending the child
        pids.append(pid)
    deadline, left, codes = time.monotonic() + limit_s, set(pids), {}
    while left and time.monotonic() < deadline:
        for pid in list(left):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                left.discard(pid)
                codes[pids.index(pid)] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)  # a reaping poll (os.waitpid has no timeout), not a wait for a result
    for pid in left:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return codes, sorted(pids.index(p) for p in left)
