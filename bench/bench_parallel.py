"""Ulysses sequence parallel: the exchange against the raw all-to-all, activation memory per
rank against the degree, and the step time of 2 ranks against 1.

- *exchange*: ``Ulysses._to_heads`` (the layout copy, ``MPI_Alltoall``, the copy back into
  (heads, tokens) order) against the raw ``ProcessGroup.all_to_all`` of the same bytes, 2
  ranks, q of 1-64 MiB per rank. Goal: >= 0.95 from 1 MiB.
- *memory*: the peak resident set a rank gains during one forward of the reference model
  (``small`` preset, 4 heads, weights whole), for the same video at Ulysses 1, 2 and 4 (4
  ranks share 2 cores here: only memory is read from that run). It should fall as 1/SP.
- *time*: one forward at Ulysses 2 on 2 ranks against 1 rank alone, at a token count where
  attention dominates.

    .venv/bin/python bench/bench_parallel.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, launch, machine, reset_peak_rss, table, vm_kib  # noqa: E402

SIZES_MIB = (1, 4, 16, 64)
# 16 frames of 32 x 32 latents with 1x2x2 patches: 4096 tokens, a (4, 4096, 4096) float32
# score matrix per attention (256 MiB) at Ulysses 1
VIDEO = dict(frames=16, height=32, width=32)


def rank_exchange() -> None:
    import numpy as np

    import hsdp
    from hsdp import parallel

    world = hsdp.distributed.init_process_group()
    sp = parallel.Ulysses(world)
    rows = []
    for mib in SIZES_MIB:
        d = 64
        h = 8 * sp.degree
        n = (mib << 20) // (h * d * 4)  # q of `mib` MiB: (1, h, n, d) float32
        # as the model hands it over: a (1, n, h, d) projection seen as (1, h, n, d)
        q = np.random.default_rng(0).standard_normal((1, n, h, d)).astype(np.float32).transpose(0, 2, 1, 3)
        send = np.ascontiguousarray(q)
        recv = np.empty_like(send)
        reps = max(5, 64 // mib)
        fns = [lambda: sp._to_heads(q), lambda: world.all_to_all(send, recv)]
        interleaved(fns, 2, sync=world.barrier)
        t_ours, t_raw = interleaved(fns, reps, sync=world.barrier)
        rows.append({"mib": mib, "ours_s": t_ours, "raw_s": t_raw})
    if world.rank == 0:
        print("RESULT " + json.dumps(rows))


def rank_forward(mode: str) -> None:
    import numpy as np

    import hsdp
    from hsdp import models, parallel

    world = hsdp.distributed.init_process_group()
    sp = parallel.Ulysses(world) if world.size > 1 else None
    model = parallel.apply_sequence_parallel(models.make_model("small", seed=0), sp)
    x = models.make_inputs("small", **VIDEO, seed=3)
    model(*x)  # warm: allocator arenas, BLAS buffers
    if mode == "memory":
        world.barrier()
        base = vm_kib("VmRSS")
        reset_peak_rss()
        model(*x)
        peak = vm_kib("VmHWM")
        gained = np.array([(peak - base) * 1024], dtype=np.int64)
        every = np.zeros(world.size, dtype=np.int64)
        world.all_gather(gained, every)
        if world.rank == 0:
            print("RESULT " + json.dumps({"ranks": world.size, "gained": every.tolist()}))
        return
    times = []
    for _ in range(5):
        world.barrier()
        t0 = time.perf_counter()
        model(*x)
        times.append(time.perf_counter() - t0)
    if world.rank == 0:
        print("RESULT " + json.dumps({"ranks": world.size, "seconds": sorted(times)[len(times) // 2]}))


def result(lines: str) -> object:
    return json.loads(next(l for l in lines.splitlines() if l.startswith("RESULT "))[7:])


def main() -> None:
    rows = []
    for r in result(launch(2, __file__, "--rank-exchange")):
        ratio = r["raw_s"] / r["ours_s"]
        rows.append([r["mib"], f"{r['raw_s'] * 1e3:.2f}", f"{r['ours_s'] * 1e3:.2f}", f"{ratio:.3f}",
                     "yes" if ratio >= 0.95 else "no"])
    print(f"Ulysses exchange (q to head-parallel) vs the raw all-to-all of the same bytes, 2 ranks ({machine()}); "
          "median ms")
    print(table(["q MiB per rank", "raw all_to_all ms", "Ulysses exchange ms", "raw / ours", ">= 0.95"], rows))

    tokens = VIDEO["frames"] * (VIDEO["height"] // 2) * (VIDEO["width"] // 2)
    mem = {n: result(launch(n, __file__, "--rank-memory")) for n in (1, 2, 4)}
    base = max(mem[1]["gained"])
    rows = [[n, f"{max(m['gained']) / 2**20:.1f}", f"{max(m['gained']) / base:.3f}", f"{1 / n:.3f}"]
            for n, m in mem.items()]
    print(f"\nPeak memory a rank gains during one forward, 'small' preset, {tokens} tokens, by Ulysses degree")
    print(table(["ulysses (ranks)", "MiB per rank (max)", "vs 1 rank", "1 / SP"], rows))

    t1 = result(launch(1, __file__, "--rank-time"))["seconds"]
    t2 = result(launch(2, __file__, "--rank-time"))["seconds"]
    print(f"\nOne forward, {tokens} tokens: 1 rank {t1:.3f} s, Ulysses 2 on 2 ranks {t2:.3f} s, ratio {t2 / t1:.3f}")


if __name__ == "__main__":
    if "--rank-exchange" in sys.argv:
        rank_exchange()
    elif "--rank-memory" in sys.argv:
        rank_forward("memory")
    elif "--rank-time" in sys.argv:
        rank_forward("time")
    else:
        main()
