"""Figure 1: an hsdp unit gather vs the raw MPI_Allgather on the same bytes.

The hsdp path is what a forward does: ``Unit.unshard()`` (queue the gather on the
collective worker thread, MPI_Allgather into a pooled buffer, wait) and ``Unit.reshard()``.
The prefetch path (``start_unshard()`` then ``wait()``) goes through the worker thread and is
timed too. The raw path is ``MPI_Allgather`` called directly on the Python thread into a preallocated
buffer from the same allocator. Ratio = raw time / hsdp time (1.0 = as fast as the raw collective; goal >= 0.95).

    .venv/bin/python bench/bench_gather.py            # 2 and 4 ranks, 1 MiB .. 256 MiB
    .venv/bin/python bench/bench_gather.py --busy     # a gather beside busy ranks: direct vs collective
    .venv/bin/python bench/bench_gather.py --wire     # the float8 wire against bfloat16

``--agreement`` measures what the agreement check costs: on the collective path
(``HSDP_DIRECT_GATHER=0``, where it runs) a 1 MiB unit gather, with the check (the tickets
beside the data, the default in groups of up to 8 ranks), against the same gather with the
check off, with the tickets in their own all-gather first (what groups of more than 8 ranks
do), the 64-byte all-gather alone and the raw 1 MiB ``MPI_Allgather``; 2 and 4 ranks, 9
launches each (a launch's placement of ranks on cores drifts more than the check costs).

``--wire`` times a 16 MiB bfloat16 unit's gather with the float8 wire (``wire_dtype=
"float8_e4m3fn"``: 8 MiB of float8 and the scales move, then are dequantized) against the
same unit without it, on 2 ranks, on both paths (direct and collective); the ratio is
float8 time / bfloat16 time.

``--busy`` times one 16 MiB gather on 2 ranks while each rank's Python thread computes for
50 ms (what a forward does while the next block prefetches), against the same gather with
both ranks idle, for the two paths a unit's gathers can take after its first: *direct*
(reading the peers' shards with process_vm_readv, the default on one host) and
*collective* (``MPI_Allgather``, ``HSDP_DIRECT_GATHER=0``). Library defaults otherwise.
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


BUSY_MIB, BUSY_S = 16, 0.05


def rank_busy() -> None:
    import os
    import statistics
    import time

    import hsdp
    from hsdp import _C

    world = hsdp.distributed.init_process_group()
    group = hsdp.init_device_mesh("cpu", (1, world.size)).shard_group
    units = {}
    for path in ("collective", "direct"):
        # read once, by the unit's first gather, which decides its path on every rank
        if path == "collective":
            os.environ["HSDP_DIRECT_GATHER"] = "0"
        else:
            os.environ.pop("HSDP_DIRECT_GATHER", None)
        u = _C.Unit(group, ["float32"], [((BUSY_MIB << 20) // 4,)], name=path)
        u.unshard()
        u.reshard()
        if u.gather_path != path:
            raise SystemExit(f"the {path} path is not available here (got {u.gather_path})")
        units[path] = u

    def span(u, busy: bool) -> float:
        world.barrier()
        u.start_unshard()
        if busy:  # the Python thread computes, as a block's forward does while the next gathers
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < BUSY_S:
                sum(range(1000))
        u.wait()
        _, start, end = u.gather_times()
        u.reshard()
        return (end - start) / 1e9

    times = {(p, b): [] for p in units for b in (False, True)}
    for _ in range(9):
        for key in times:
            times[key].append(span(units[key[0]], key[1]))
    if world.rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print("RESULT " + json.dumps({f"{p}/{'busy' if b else 'idle'}": t for (p, b), t in med.items()}))


WIRE_MIB = 16


def rank_wire() -> None:
    import os

    import numpy as np

    import hsdp
    from hsdp import _C
    from harness import interleaved

    world = hsdp.distributed.init_process_group()
    group = hsdp.init_device_mesh("cpu", (1, world.size)).shard_group
    n = (WIRE_MIB << 20) // 2
    values = (np.random.default_rng(0).standard_normal(n) * 0.02).astype(np.float32)
    res = {}
    for path in ("direct", "collective"):
        if path == "collective":
            os.environ["HSDP_DIRECT_GATHER"] = "0"  # read by each unit's first gather
        units = []
        for wire in (None, "float8_e4m3fn"):
            u = _C.Unit(group, ["bfloat16"], [(n,)], name=f"{path}-{wire}", compute_dtypes=["bfloat16"],
                        wire_dtype=wire)
            u.write(0, values)
            u.encode()
            units.append(u)

        def gather(u):
            def run() -> None:
                u.unshard()
                u.reshard()
            return run

        fns = [gather(u) for u in units]
        interleaved(fns, 3, sync=world.barrier)
        t_bf16, t_fp8 = interleaved(fns, 25, sync=world.barrier)
        assert all(u.gather_path == path for u in units), [u.gather_path for u in units]
        res[path] = {"bf16_s": t_bf16, "fp8_s": t_fp8, "wire_bytes": units[1].wire_chunk_bytes * world.size,
                     "bf16_bytes": units[0].total_bytes}
    if world.rank == 0:
        print("RESULT " + json.dumps(res))


def rank_agreement() -> None:
    import os
    import statistics

    import numpy as np

    import hsdp
    from hsdp import _C
    from harness import interleaved

    os.environ["HSDP_DIRECT_GATHER"] = "0"  # the check runs on collective gathers
    world = hsdp.distributed.init_process_group()
    group = hsdp.init_device_mesh("cpu", (1, world.size)).shard_group
    nbytes = 1 << 20
    unit = _C.Unit(group, ["float32"], [(nbytes // 4,)], name="1MiB")
    send, recv = _C.empty_aligned(unit.chunk_bytes), _C.empty_aligned(unit.total_bytes)
    ticket, tickets = np.zeros(64, np.uint8), np.zeros(64 * world.size, np.uint8)

    def ours() -> None:
        unit.unshard()
        unit.reshard()

    def with_check(mode: object):  # the same gather in another mode (on every rank, in step)
        def gather() -> None:
            _C._set_agreement_check(mode)
            ours()
            _C._set_agreement_check(True)
        return gather

    # off: a plain MPI_Allgather; "separate": the tickets' own all-gather first (groups of more than 8)
    fns = [ours, with_check(False), lambda: group.all_gather(send, recv), lambda: group.all_gather(ticket, tickets),
           with_check("separate")]
    interleaved(fns, 5, sync=world.barrier)
    t_ours, t_off, t_raw, t_check, t_sep = interleaved(fns, 1000, sync=world.barrier, stat=list)
    assert unit.gather_path == "collective", unit.gather_path
    if world.rank == 0:
        med = statistics.median
        # the cost as the median of each repetition's own ratio: neighbours in time share the
        # machine's state, which drifts between runs more than the check costs
        print("RESULT " + json.dumps({"ranks": world.size, "ours_s": med(t_ours), "off_s": med(t_off),
                                      "raw_s": med(t_raw), "check_s": med(t_check),
                                      "cost": med([a / b for a, b in zip(t_ours, t_off)]) - 1,
                                      "separate_cost": med([a / b for a, b in zip(t_sep, t_off)]) - 1}))


def main() -> None:
    from harness import launch, machine, table

    if "--agreement" in sys.argv:
        import statistics

        rows = []
        launches = 9  # a launch's ranks land on the cores in a way that drifts more than the check costs
        for n in (2, 4):
            runs = [json.loads(next(l for l in launch(n, "bench/bench_gather.py", "--rank-agreement").splitlines()
                                    if l.startswith("RESULT "))[7:]) for _ in range(launches)]
            r = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            costs = sorted(run["cost"] for run in runs)
            rows.append([n, f"{r['ours_s'] * 1e6:.1f}", f"{r['off_s'] * 1e6:.1f}", f"{r['cost'] * 100:+.1f}%",
                         f"{costs[0] * 100:+.1f}% .. {costs[-1] * 100:+.1f}%", f"{r['separate_cost'] * 100:+.1f}%",
                         f"{r['check_s'] * 1e6:.1f}",
                         f"{r['raw_s'] * 1e6:.1f}", f"{r['raw_s'] / r['ours_s']:.3f}"])
        print(f"The agreement check on a 1 MiB collective unit gather ({machine()}); median over {launches} launches "
              "of each launch's median, 1000 repetitions interleaved")
        print(table(["ranks", "gather us", "gather, check off us", "check's cost", "cost's range",
                     "cost with its own round trip",
                     "64-byte all-gather from Python us", "raw 1 MiB us", "raw / gather"], rows))
        return

    if "--wire" in sys.argv:
        line = next(l for l in launch(2, "bench/bench_gather.py", "--rank-wire").splitlines() if l.startswith("RESULT "))
        r = json.loads(line[7:])
        rows = [[p, f"{r[p]['bf16_bytes'] / 2**20:.2f}", f"{r[p]['wire_bytes'] / 2**20:.2f}",
                 f"{r[p]['bf16_s'] * 1e3:.2f}", f"{r[p]['fp8_s'] * 1e3:.2f}", f"{r[p]['fp8_s'] / r[p]['bf16_s']:.2f}"]
                for p in ("direct", "collective")]
        print(f"A {WIRE_MIB} MiB bfloat16 unit gathered as bfloat16 and with the float8 wire, 2 ranks "
              f"({machine()}); median ms of unshard + reshard, 25 interleaved")
        print(table(["path", "bfloat16 MiB", "float8 wire MiB", "bfloat16 ms", "float8 ms", "float8 / bfloat16"], rows))
        return

    if "--busy" in sys.argv:
        line = next(l for l in launch(2, "bench/bench_gather.py", "--rank-busy").splitlines() if l.startswith("RESULT "))
        r = json.loads(line[7:])
        rows = [[p, f"{r[p + '/idle'] * 1e3:.2f}", f"{r[p + '/busy'] * 1e3:.2f}",
                 f"{r[p + '/busy'] / r[p + '/idle']:.2f}"] for p in ("collective", "direct")]
        print(f"One {BUSY_MIB} MiB unit gather, 2 ranks, idle vs beside {BUSY_S * 1e3:.0f} ms of compute on each "
              f"rank ({machine()}); median ms from the gather's start to its end on the worker")
        print(table(["path", "idle ms", "beside compute ms", "beside / idle"], rows))
        print(f"collective / direct beside compute: {r['collective/busy'] / r['direct/busy']:.1f}")
        return

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
    if "--rank-busy" in sys.argv:
        rank_busy()
    elif "--rank-wire" in sys.argv:
        rank_wire()
    elif "--rank-agreement" in sys.argv:
        rank_agreement()
    elif "--rank" in sys.argv:
        rank_main()
    else:
        main()
