"""The torch parity checks through the real NCCL backend, against the fake CUDA/NCCL library
with a CPU-only torch (started by tests/test_nccl.py).

usage: nccl_torch_fake.py FAKE_SO N

Under FAKE_HOST_VIEW=1 the fake says its device memory is host memory the host reads, so the
backend views its buffers as the CPU (csrc/backend_nccl.c, nccl_host_device): torch tensors on
the CPU go through NCCL's device collectives, gathers and all-to-alls. The fake's worlds of
several ranks are processes forked from the one that made the unique id (its shared region
is inherited), as in bench/gpu_check_multi.py --dry-run: this process loads the fake, makes
the id and forks N ranks; each joins the world and runs, in order, tests/torch_worker.py's
stock Wan in float32 (with the agreement tickets) and bfloat16 (without) and stock Flux in
bfloat16, sharded over N, bit for bit equal to the unsharded reference, and
tests/parallel_torch_worker.py's HSDP x
Ulysses Wan in float32.
Prints "rank R: ..." lines from the workers, then "all N ranks ok", or exits 1.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

os.environ["FAKE_HOST_VIEW"] = "1"  # read by the fake when the backend loads it
os.environ["HSDP_TEST_BACKEND"] = "nccl"  # tests/torch_models.worker_world

import torch  # noqa: E402,F401  (imported once, before the fork: each rank inherits it)

import hsdp  # noqa: E402
import parallel_torch_worker  # noqa: E402
import torch_worker  # noqa: E402
from hsdp import _C  # noqa: E402
from hsdp.world import distributed, nccl  # noqa: E402

LIMIT_S = 120.0  # a rank still running then is a hang


def rank_main(uid: bytes, rank: int, n: int) -> None:
    """One forked rank: join the fake's world, run the cases, exit 0 when every one passed."""
    code = 1
    try:
        _C.set_timeout(60.0)
        world = nccl.join(uid, rank, n, rank % 2)  # the fake has 2 devices
        assert world.backend == "nccl" and world.rank == rank and world.size == n, (world.backend, world.rank)
        info = hsdp.world.devices.of_group(world)
        assert (info.device, info.framework, info.dlpack) == ("cuda", "cpu", (1, 0)), info
        # the world the id exchange would have made: what init_process_group returns from now on
        distributed._world = world
        distributed.register_teardown()
        torch_worker.main("wan", "float32", 1, n)
        # without the agreement tickets (which the host waits for, behind the data) only the
        # gather's own wait keeps torch from reading a buffer the fake's stream still writes
        _C._set_agreement_check(False)
        torch_worker.main("wan", "bfloat16", 1, n)
        torch_worker.main("flux", "bfloat16", 1, n)
        sys.argv = ["parallel_torch_worker.py", "float32"]
        parallel_torch_worker.main()
        distributed.destroy_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def main(fake: str, n: int) -> int:
    _C.nccl_load(fake, fake)
    assert nccl.host_reads(), "the fake did not say its device memory is host memory (FAKE_HOST_VIEW)"
    uid = _C.nccl_unique_id()
    sys.stdout.flush(), sys.stderr.flush()
    pids = []
    for r in range(n):
        pid = os.fork()
        if pid == 0:
            rank_main(uid, r, n)
        pids.append(pid)
    deadline, left, codes = time.monotonic() + LIMIT_S, set(pids), {}
    while left and time.monotonic() < deadline:
        for pid in list(left):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                left.discard(pid)
                codes[pids.index(pid)] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    for pid in left:  # a hang: end the ranks this process forked
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if left or any(codes.values()):
        print(f"FAILED: exit statuses {codes}, hung ranks {sorted(pids.index(p) for p in left)}", flush=True)
        return 1
    print(f"all {n} ranks ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
