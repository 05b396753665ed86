"""Figure 1: an hsdp unit gather vs the raw MPI_Allgather on the same bytes.

The hsdp path is what a forward does: ``Unit.unshard()`` (queue the gather on the
collective worker thread, MPI_Allgather into a pooled buffer, wait) and ``Unit.reshard()``.
The prefetch path (``start_unshard()`` then ``wait()``) goes through the worker thread and is
timed too. The raw path is ``MPI_Allgather`` called directly on the Python thread into a preallocated
buffer from the same allocator. Ratio = raw time / hsdp time (1.0 = as fast as the raw collective; goal >= 0.95).

    .venv/bin/python bench/bench_gather.py            # 2 and 4 ranks, 1 MiB .. 256 MiB
"""

from __future__ import annotations

import json
import sys

SIZES_MIB = (1, 4, 16, 64, 256)


def rank_main() -> None:
    import numpy as np

    import hsdp
    from hsdp import _C
    from harness import interleaved

    world = hsdp.distributed.init_process_group()
    mesh = hsdp.init_device_mesh("cpu", (1, world.size))
    group = mesh.shard_group
    _C.set_pool_capacity(2)
    rows = []
    for mib in SIZES_MIB:
        nbytes = mib << 20
        unit = _C.Unit(group, ["float32"], [(nbytes // 4,)], name=f"{mib}MiB")
        assert unit.total_bytes == nbytes
        # the raw path gathers into memory from the same allocator as hsdp's buffers, so the
        # two differ only in the path, not in page placement
        send = _C.empty_aligned(unit.chunk_bytes)
        send[:] = 1
        recv = _C.empty_aligned(unit.total_bytes)

        def ours() -> None:
            unit.unshard()
            unit.reshard()

        def ours_worker() -> None:  # the prefetch path: queued on the worker thread, then waited
            unit.start_unshard()
            unit.wait()
            unit.reshard()

        def raw() -> None:
            group.all_gather(send, recv)

        reps = max(5, min(60, 256 // mib))
        fns = [ours, ours_worker, raw]
        interleaved(fns, 2, sync=world.barrier)  # warm the pool and the transport
        t_ours, t_worker, t_raw = interleaved(fns, reps, sync=world.barrier)
        rows.append({"mib": mib, "ours_s": t_ours, "worker_s": t_worker, "raw_s": t_raw})
        del unit
    if world.rank == 0:
        print("RESULT " + json.dumps({"ranks": world.size, "rows": rows}))


def main() -> None:
    from harness import launch, machine, table

    out = []
    for n in (2, 4):
        line = next(l for l in launch(n, "bench/bench_gather.py", "--rank").splitlines() if l.startswith("RESULT "))
        res = json.loads(line[7:])
        for r in res["rows"]:
            ratio = r["raw_s"] / r["ours_s"]
            wratio = r["raw_s"] / r["worker_s"]
            out.append([n, r["mib"], f"{r['raw_s'] * 1e3:.2f}", f"{r['ours_s'] * 1e3:.2f}",
                        f"{r['worker_s'] * 1e3:.2f}", f"{r['mib'] / 1024 / r['raw_s']:.2f}",
                        f"{r['mib'] / 1024 / r['ours_s']:.2f}", f"{ratio:.3f}", f"{wratio:.3f}",
                        "yes" if min(ratio, wratio) >= 0.95 else "no"])
    print(f"hsdp unit gather vs raw MPI_Allgather ({machine()}); median ms per gather")
    print("hsdp = Unit.unshard()+reshard() (synchronous: on the caller when the worker is idle); "
          "worker = start_unshard()+wait()+reshard() (the prefetch path, through the worker thread)")
    print(table(["ranks", "MiB", "raw ms", "hsdp ms", "worker ms", "raw GiB/s", "hsdp GiB/s", "raw/hsdp",
                 "raw/worker", ">= 0.95"], out))


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    rank_main() if "--rank" in sys.argv else main()
