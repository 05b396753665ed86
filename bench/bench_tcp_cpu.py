"""Where the float8 wire's time goes over TCP (docs/performance.md, "Float8 on the wire"): two
ranks in two network namespaces joined by veth (bench/netns.py; root and `ip netns` needed),
as bench/bench_tcp.py. Per rank: the median ms (25, interleaved) of a 16 MiB bfloat16 unit's
gather, the same unit with the float8 wire, a bfloat16 unit of the float8 unit's 8.25 MiB,
and the raw MPI_Allgather of 8.25 and 16 MiB; then, over 30 back-to-back repetitions of each,
the process's CPU use (getrusage user + sys, all threads, against wall time), its CPU ms per
repetition, and how long its threads waited runnable for a CPU (/proc/self/task/*/schedstat,
summed over threads, against wall time): whether the cores are saturated, and by whom.

    .venv/bin/python bench/bench_tcp_cpu.py
"""

from __future__ import annotations

import glob
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def sched() -> tuple[int, int]:
    """(ns on a CPU, ns waiting runnable) summed over this process's threads."""
    cpu = wait = 0
    for f in glob.glob("/proc/self/task/*/schedstat"):
        try:
            a = open(f).read().split()
        except OSError:  # a thread that ended meanwhile
            continue
        cpu, wait = cpu + int(a[0]), wait + int(a[1])
    return cpu, wait


def rank() -> None:
    import numpy as np

    import hsdp
    from hsdp import _C
    from harness import interleaved

    world = hsdp.distributed.init_process_group()
    n = 8 << 20  # 16 MiB of bfloat16
    values = (np.random.default_rng(0).standard_normal(n) * 0.02).astype(np.float32)
    units = {}
    for name, wire, numel in (("bf16", None, n), ("fp8", "float8_e4m3fn", n), ("bf16_fp8_bytes", None, n * 33 // 64)):
        u = _C.Unit(world, ["bfloat16"], [(numel,)], name=name, compute_dtypes=["bfloat16"], wire_dtype=wire)
        u.write(0, values[:numel])
        units[name] = u

    def gather(u):
        def run() -> None:
            u.unshard()
            u.reshard()
        return run

    w8 = units["fp8"].wire_chunk_bytes
    s8, r8 = _C.empty_aligned(w8), _C.empty_aligned(w8 * world.size)
    s16, r16 = _C.empty_aligned(n), _C.empty_aligned(n * world.size)
    ops = {**{k: gather(u) for k, u in units.items()}, "raw8": lambda: world.all_gather(s8, r8),
           "raw16": lambda: world.all_gather(s16, r16)}
    interleaved(list(ops.values()), 2, sync=world.barrier)
    res = {"rank": world.rank, "ms": dict(zip(ops, (round(t * 1e3, 2) for t in
                                                     interleaved(list(ops.values()), 25, sync=world.barrier))))}
    for k, fn in ops.items():
        world.barrier()
        s0, r0, w0 = sched(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(30):
            fn()
        s1, r1, w1 = sched(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        res[k] = {"cores": round(cpu / (w1 - w0), 2), "cpu_ms": round(cpu / 30 * 1e3, 2),
                  "runnable_waiting": round((s1[1] - s0[1]) / 1e9 / (w1 - w0), 2)}
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    import netns

    out = netns.run_on_two_hosts([__file__, "--rank"], HERE.parent, "bench_tcp_cpu")
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"2 ranks over TCP (veth); load average {load} on {os.cpu_count()} cores at the end")
    # each rank's RESULT object, read where it starts: the ranks' lines may run into each other
    for r in sorted((json.JSONDecoder().raw_decode(out, m.end())[0] for m in re.finditer(r"RESULT ", out)),
                    key=lambda r: r["rank"]):
        print(f"rank {r['rank']}: median ms " + ", ".join(f"{k} {v}" for k, v in r["ms"].items()))
        for k in r["ms"]:
            print(f"  {k}: {r[k]['cores']} cores busy, {r[k]['cpu_ms']} CPU ms each, "
                  f"threads waiting runnable {r[k]['runnable_waiting']} of the wall time")


if __name__ == "__main__":
    rank() if "--rank" in sys.argv else main()
