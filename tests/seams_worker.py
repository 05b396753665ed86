"""One rank of the backend-seam checks (started by tests/test_seams.py under mpiexec).

`python tests/seams_worker.py` checks, on every rank, that the world group runs on the MPI
backend with its worker thread (``overlaps``), and that ``all_to_all`` delivers block j of
rank i's send as block i of rank j's recv, on the world and on split groups, with values
distinct per (source, destination). A failure raises out of main; hsdp then skips
MPI_Finalize at exit, so mpiexec ends the other ranks instead of leaving them waiting.
"""

from __future__ import annotations

import numpy as np

import hsdp
from hsdp.world.distributed import init_process_group

K = 3  # elements per block


def tag(src: int, dst: int, k: int = K) -> np.ndarray:
    """The block rank `src` sends to rank `dst`: distinct for every (src, dst, element)."""
    return np.arange(k, dtype=np.int64) + 1000 * src + 10 * dst


def check_all_to_all(group, label: str) -> None:
    """Block j of send goes to group rank j and arrives as block <my group rank> of its recv."""
    me, n = group.rank, group.size
    send = np.concatenate([tag(me, j) for j in range(n)])
    recv = np.full(n * K, -1, dtype=np.int64)
    group.all_to_all(send, recv)
    expect = np.concatenate([tag(i, me) for i in range(n)])
    assert np.array_equal(recv, expect), (label, me, recv, expect)
    # shapes do not matter, only bytes: a (size, K) float64 pair gives the same routing
    send2 = np.stack([tag(me, j).astype(np.float64) for j in range(n)])
    recv2 = np.zeros_like(send2)
    group.all_to_all(send2, recv2)
    assert np.array_equal(recv2, expect.reshape(n, K).astype(np.float64)), (label, me, recv2)


def main() -> None:
    world = init_process_group()
    assert world.backend == "mpi", world.backend
    assert world.overlaps is True, world.overlaps
    assert hsdp.distributed.backends()["mpi"] is None
    n, me = world.size, world.rank

    check_all_to_all(world, "world")

    # split groups: ranks of one parity, ordered by descending world rank (group rank != world rank)
    sub = world.split(color=me % 2, key=-me)
    members = sorted((r for r in range(n) if r % 2 == me % 2), reverse=True)
    assert (sub.backend, sub.size, sub.rank) == ("mpi", len(members), members.index(me)), sub
    assert sub.overlaps is True
    check_all_to_all(sub, "split")

    # a mesh's shard group (2 x n/2 when n allows, else 1 x n)
    R = 2 if n % 2 == 0 and n > 2 else 1
    mesh = hsdp.init_device_mesh("cpu", (R, n // R))
    assert mesh.shard_group.backend == "mpi" and mesh.shard_group.overlaps is True
    check_all_to_all(mesh.shard_group, "shard group")
    check_all_to_all(mesh.replicate_group, "replicate group")

    # every rank checks its own arguments before the collective, so these fail locally on all
    send = np.zeros(n * K, dtype=np.int64)
    for bad_recv, what in ((send, "overlap"), (np.zeros(n * K + 1, np.int64), "size")):
        try:
            world.all_to_all(send, bad_recv)
        except ValueError as exc:
            assert ("overlap" in str(exc)) if what == "overlap" else ("bytes" in str(exc)), exc
        else:
            raise AssertionError(f"all_to_all with a bad recv ({what}) did not raise")

    # all_gather and broadcast on the same backend, as the loader's agreement uses them
    got = np.zeros(n, dtype=np.int64)
    world.all_gather(np.array([me * 7], dtype=np.int64), got)
    assert np.array_equal(got, np.arange(n) * 7), got
    b = np.full(4, me, dtype=np.int32)
    world.broadcast(b, n - 1)
    assert np.array_equal(b, np.full(4, n - 1)), b
    world.barrier()
    assert world.overlaps is True  # the worker still runs after collectives on this thread
    print(f"rank {me}/{n} seams OK", flush=True)


if __name__ == "__main__":
    main()
