"""The torch parity checks through the real NCCL backend, against the fake CUDA/NCCL library
with a CPU-only torch (started by tests/test_nccl.py).

usage: nccl_torch_fake.py FAKE_SO N [N ...]     each N: 2 or 4, one world after the other

Under FAKE_HOST_VIEW=1 the fake says its device memory is host memory the host reads, so the
backend views its buffers as the CPU (csrc/nccl_device.c, nccl_host_device), and torch's CPU
tensors are device memory to it, as CUDA tensors are on a GPU: they go to NCCL's device
collectives, gathers, all-to-alls and point to point as they are. The fake's worlds of
several ranks are processes forked from the one that made the unique id (its shared region
is inherited), as in bench/gpu_check_multi.py --dry-run: this process loads the fake, and
for each world makes a fresh id and forks its N ranks; each joins the world and runs, in order:
- 2 ranks: tests/torch_worker.py's stock Wan in float32 (with the agreement tickets) on the
  meshes 1x2 and 2x1, then without the tickets the stock Wan and Flux in bfloat16 on 1x2, each
  sharded and bit for bit equal to the unsharded reference; tests/parallel_torch_worker.py's
  HSDP x Ulysses Wan in float32 (within 1e-5); and tests/parallel_torch_ring.py's sharded Wan
  in float32 with ring attention over the 2 ranks (its k/v blocks by ncclSend/ncclRecv, within
  1e-5 as on MPI) and with CFG parallel (the two branches all-gathered: bit for bit);
- 4 ranks: the stock Wan in float32 on the mesh 2x2, bit for bit, and the sharded Wan with
  ring attention x CFG parallel (ring groups {0, 1} and {2, 3}), within 1e-5.
Prints "rank R: ..." lines from the workers and "all N ranks ok" for each world, or exits 1.
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ["FAKE_HOST_VIEW"] = "1"  # read by the fake when the backend loads it
os.environ["HSDP_TEST_BACKEND"] = "nccl"  # tests/torch_models.worker_world

import torch  # noqa: E402,F401  (imported once, before the fork: each rank inherits it)
from diffusers import FluxTransformer2DModel, WanTransformer3DModel  # noqa: E402,F401  (so are the models)

import hsdp  # noqa: E402
import parallel_torch_ring  # noqa: E402
import parallel_torch_worker  # noqa: E402
import torch_worker  # noqa: E402
from hsdp import _C, parallel  # noqa: E402
from hsdp.testing.forked import fork_ranks  # noqa: E402
from hsdp.engine.config import DiffusionParallelConfig  # noqa: E402
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
        if n == 4:
            torch_worker.main("wan", "float32", 2, 2)
            legs = [("ring x cfg", {"ring_degree": 2, "cfg_parallel_size": 2})]
        else:
            legs = [("ring", {"ring_degree": n}), ("cfg", {"cfg_parallel_size": n})]
            torch_worker.main("wan", "float32", 1, n)
            torch_worker.main("wan", "float32", n, 1)  # replicated: shard groups of one rank
            # without the agreement tickets (which the host waits for, behind the data) only the
            # gather's own wait keeps torch from reading a buffer the fake's stream still writes
            _C._set_agreement_check(False)
            torch_worker.main("wan", "bfloat16", 1, n)
            torch_worker.main("flux", "bfloat16", 1, n)
            sys.argv = ["parallel_torch_worker.py", "float32"]
            parallel_torch_worker.main()
        for what, layout in legs:
            groups = parallel.init_parallel_groups(DiffusionParallelConfig(use_hsdp=True, **layout), world)
            rel = parallel_torch_ring.check_wan(groups, target_device=info.framework)
            assert what != "cfg" or rel == 0, f"CFG parallel alone differs: relative {rel:.3g}"
            print(f"rank {rank}: torch {what} ok on nccl ({groups.describe()}), relative {rel:.3g}", flush=True)
        distributed.destroy_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def world(n: int) -> int:
    """Forks a world of n ranks over a fresh unique id (a shared region of its own), waits for
    them; 0 when every rank passed."""
    uid = _C.nccl_unique_id()
    codes, hung = fork_ranks(n, lambda r: rank_main(uid, r, n), LIMIT_S)
    if hung or any(codes.values()):
        print(f"FAILED: exit statuses {codes}, hung ranks {hung}", flush=True)
        return 1
    print(f"all {n} ranks ok", flush=True)
    return 0


def main(fake: str, sizes: list[int]) -> int:
    """One world after the other, in this one process (torch and the models imported once)."""
    _C.nccl_load(fake, fake)
    assert nccl.host_reads(), "the fake did not say its device memory is host memory (FAKE_HOST_VIEW)"
    for n in sizes:
        if n not in (2, 4):
            raise SystemExit(f"nccl_torch_fake.py: a world of {n} ranks has no cases (2 or 4)")
        if world(n):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], [int(a) for a in sys.argv[2:]]))
