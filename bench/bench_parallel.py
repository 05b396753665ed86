"""Ulysses sequence parallel: the exchange against the raw all-to-all, activation memory per
rank against the degree, and the step time of 2 ranks against 1.

- *exchange*: q to head-parallel as the reference model hands it over (its norm writes it
  into ``Ulysses.grouped``, so ``MPI_Alltoall`` sends it as it lies) against the raw
  ``ProcessGroup.all_to_all`` of the same bytes, 2 ranks, q of 1-64 MiB per rank. Goal:
  >= 0.95 from 1 MiB. Also timed: the strided path (a (tokens, heads) projection sent with
  derived datatypes, what any other caller of ``Ulysses.attention`` gets), and what the
  layout costs inside the norm (its last multiply in place against into the grouped buffer).
- *memory*: the peak resident set a rank gains during one forward of the reference model
  (``small`` preset, 4 heads, weights whole), for the same video at Ulysses 1, 2 and 4 (4
  ranks share 2 cores here: only memory is read from that run). It should fall as 1/SP.
- *time*: one forward at Ulysses 2 on 2 ranks against 1 rank alone, at a token count where
  attention dominates; and on 2 ranks, interleaved, the same forward with q, k, v written
  grouped (the default) against strided (the path before).

Ring attention (``--ring``: this section alone):

- *ring exchange*: one ring step's transfer as :class:`hsdp.ring.Ring` makes it (k and v
  copied into one buffer, ``sendrecv_start`` + ``sendrecv_wait``) against the raw
  ``ProcessGroup.sendrecv`` of the same bytes, 2 ranks, k+v of 1-64 MiB per rank.
- *ring attention time*: attention over a long sequence (4 heads, 8192 tokens, head dim 64)
  on 1 rank against ring 2 on 2 ranks (each rank's share of the queries over every key).
- *ring memory*: the peak a rank gains during one forward of the reference model, as above,
  at ring 1, 2 and 4. Goal: 1/ring.

    .venv/bin/python bench/bench_parallel.py
    .venv/bin/python bench/bench_parallel.py --ring
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
        y = np.random.default_rng(0).standard_normal((1, n, h * d)).astype(np.float32)
        w = np.random.default_rng(1).standard_normal(h * d).astype(np.float32)
        # as the reference model hands q over: written by its norm into grouped() (here a multiply)
        q = sp.grouped(1, n, h, d, np.float32)
        np.multiply(y.reshape(q.shape), w.reshape(q.shape[2:]), out=q)
        # as a model computing (1, n, h, d) projections hands it over: seen as (1, h, n, d)
        strided = (y * w).reshape(1, n, h, d).transpose(0, 2, 1, 3)
        send = np.ascontiguousarray(strided)
        recv = np.empty_like(send)
        scratch = y.copy()
        reps = max(15, 256 // mib)
        ours, raw = (lambda: sp._to_heads_grouped(q, d)), (lambda: world.all_to_all(send, recv))
        fns = [ours, raw, raw, ours,  # A B B A: a call's place in the round moves its time here
               lambda: sp._to_heads(strided),
               # what the layout costs inside the norm: its last multiply in place vs into grouped()
               lambda: np.multiply(scratch, w, out=scratch),
               lambda: np.multiply(scratch.reshape(q.shape), w.reshape(q.shape[2:]), out=q)]
        interleaved(fns, 2, sync=world.barrier)
        o1, r1, r2, o2, t_strided, t_inplace, t_into = interleaved(fns, reps, sync=world.barrier)
        t_ours, t_raw = (o1 + o2) / 2, (r1 + r2) / 2
        rows.append({"mib": mib, "ours_s": t_ours, "raw_s": t_raw, "strided_s": t_strided,
                     "inplace_s": t_inplace, "into_s": t_into})
    if world.rank == 0:
        print("RESULT " + json.dumps(rows))


RING_SEQ = dict(b=1, h=4, n=8192, d=64)


def rank_ring_exchange() -> None:
    import numpy as np

    import hsdp
    from hsdp.parallel.ring import Ring

    world = hsdp.distributed.init_process_group()
    ring = Ring(world)
    dest, source = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    rows = []
    for mib in SIZES_MIB:
        n = (mib << 20) // (2 * 4 * 64 * 4)  # k and v (1, 4, n, 64) float32: `mib` MiB together
        k, v = (np.random.default_rng(i).standard_normal((1, 4, n, 64)).astype(np.float32) for i in range(2))

        def ours() -> None:  # what one ring step moves, as Ring.attention moves it
            cur, nxt = ring._buffers((2, *k.shape), k.dtype)
            cur[0], cur[1] = k, v
            world.sendrecv_start(cur, dest, nxt, source)
            world.sendrecv_wait()

        def onward() -> None:  # a later step: the block received is sent on as it lies, no packing
            cur, nxt = ring._buffers((2, *k.shape), k.dtype)
            world.sendrecv_start(cur, dest, nxt, source)
            world.sendrecv_wait()

        send, recv = np.stack([k, v]), np.empty((2, *k.shape), np.float32)
        raw = lambda: world.sendrecv(send, dest, recv, source)  # noqa: E731
        fns = [ours, raw, onward, onward, raw, ours]
        interleaved(fns, 2, sync=world.barrier)
        o1, r1, w1, w2, r2, o2 = interleaved(fns, max(9, 128 // mib), sync=world.barrier)
        rows.append({"mib": mib, "ours_s": (o1 + o2) / 2, "raw_s": (r1 + r2) / 2, "onward_s": (w1 + w2) / 2})
    if world.rank == 0:
        print("RESULT " + json.dumps(rows))


def rank_ring_time() -> None:
    import numpy as np

    import hsdp
    from hsdp.parallel.ring import Ring, block_attention

    world = hsdp.distributed.init_process_group()
    b, h, n, d = RING_SEQ.values()
    q, k, v = (np.random.default_rng(i).standard_normal((b, h, n, d)).astype(np.float32) for i in range(3))
    if world.size == 1:
        fn = lambda: block_attention(q, k, v, d ** -0.5)  # noqa: E731
    else:
        ring, m = Ring(world), n // world.size
        lo = world.rank * m
        mine = [np.ascontiguousarray(t[:, :, lo:lo + m]) for t in (q, k, v)]
        fn = lambda: ring.attention(*mine)  # noqa: E731
    fn()
    times = []
    for _ in range(3):
        world.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if world.rank == 0:
        print("RESULT " + json.dumps({"ranks": world.size, "seconds": sorted(times)[1]}))


def rank_forward(mode: str) -> None:
    import numpy as np

    import hsdp
    from hsdp import models, parallel

    world = hsdp.distributed.init_process_group()
    sp = parallel.Ulysses(world) if world.size > 1 else None
    if "--ring-memory" in sys.argv and world.size > 1:  # ring attention over every rank
        from hsdp.parallel.ring import USP, Ring

        sp = USP(world, None, Ring(world))
    model = parallel.apply_sequence_parallel(models.make_model("small", seed=0), sp)
    x = models.make_inputs("small", **VIDEO, seed=3)
    model(*x)  # warm: allocator arenas, BLAS buffers
    if mode == "memory":
        import tracemalloc

        world.barrier()
        base = vm_kib("VmRSS")
        reset_peak_rss()
        model(*x)
        peak = vm_kib("VmHWM")
        # NumPy reports its arrays to tracemalloc: the peak of live arrays during the forward,
        # whether or not the allocator had the pages resident already
        tracemalloc.start()
        model(*x)
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        gained = np.array([(peak - base) * 1024, traced], dtype=np.int64)
        every = np.zeros((world.size, 2), dtype=np.int64)
        world.all_gather(gained, every)
        if world.rank == 0:
            print("RESULT " + json.dumps({"ranks": world.size, "gained": every[:, 0].tolist(),
                                          "traced": every[:, 1].tolist()}))
        return
    if mode == "layouts":  # the same forward with q, k, v grouped (the default) or strided, interleaved
        from hsdp.models import dit
        from hsdp.nn import functional as F

        grouped = dit.Attention._ulysses

        def strided(self, x, sp):  # (tokens, heads) projections, sent with derived datatypes
            q = self._heads(self.norm_q(self.q(x)))
            k = self._heads(self.norm_k(self.k(x)))
            v = self._heads(self.v(x))
            return sp.attention(q, k, v, F.scaled_dot_product_attention)

        def run(impl):
            def forward() -> None:
                dit.Attention._ulysses = impl
                model(*x)
            return forward

        # A B B A: the first forward after the barrier runs a few percent slower here
        g1, s1, s2, g2 = interleaved([run(grouped), run(strided), run(strided), run(grouped)], 5, sync=world.barrier)
        t_grouped, t_strided = (g1 + g2) / 2, (s1 + s2) / 2
        dit.Attention._ulysses = grouped
        if world.rank == 0:
            print("RESULT " + json.dumps({"grouped_s": t_grouped, "strided_s": t_strided}))
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


def ring_main() -> None:
    rows = []
    for r in result(launch(2, __file__, "--rank-ring-exchange")):
        rows.append([r["mib"], f"{r['raw_s'] * 1e3:.2f}", f"{r['ours_s'] * 1e3:.2f}",
                     f"{r['raw_s'] / r['ours_s']:.3f}", f"{r['onward_s'] * 1e3:.2f}",
                     f"{r['raw_s'] / r['onward_s']:.3f}"])
    print(f"Ring step vs the raw sendrecv of the same bytes, 2 ranks ({machine()}); median ms. 'first step': "
          f"k, v packed into the ring buffer + sendrecv_start/wait; 'later step': the received block sent on")
    print(table(["k+v MiB per rank", "raw sendrecv ms", "first step ms", "raw / first", "later step ms",
                 "raw / later"], rows))
    t1 = result(launch(1, __file__, "--rank-ring-time"))["seconds"]
    t2 = result(launch(2, __file__, "--rank-ring-time"))["seconds"]
    b, h, n, d = RING_SEQ.values()
    print(f"\nAttention, {h} heads x {n} tokens x head dim {d}, float32: 1 rank {t1:.3f} s, ring 2 on 2 ranks "
          f"{t2:.3f} s, ratio {t2 / t1:.3f}")
    tokens = VIDEO["frames"] * (VIDEO["height"] // 2) * (VIDEO["width"] // 2)
    mem = {n: result(launch(n, __file__, "--rank-memory", "--ring-memory")) for n in (1, 2, 4)}
    base, tbase = max(mem[1]["gained"]), max(mem[1]["traced"])
    rows = [[n, f"{max(m['traced']) / 2**20:.1f}", f"{max(m['traced']) / tbase:.3f}",
             f"{max(m['gained']) / 2**20:.1f}", f"{max(m['gained']) / base:.3f}", f"{1 / n:.3f}"]
            for n, m in mem.items()]
    print(f"\nActivation memory per rank during one forward, 'small' preset, {tokens} tokens, by ring degree: "
          f"the peak of live NumPy arrays (tracemalloc), and the resident set gained beyond the warm-up's")
    print(table(["ring (ranks)", "live arrays MiB (max)", "vs 1 rank", "RSS gained MiB (max)", "vs 1 rank",
                 "1 / ring"], rows))


def main() -> None:
    if "--ring" in sys.argv:
        ring_main()
        return
    rows = []
    for r in result(launch(2, __file__, "--rank-exchange")):
        ratio = r["raw_s"] / r["ours_s"]
        rows.append([r["mib"], f"{r['raw_s'] * 1e3:.2f}", f"{r['ours_s'] * 1e3:.2f}", f"{ratio:.3f}",
                     "yes" if ratio >= 0.95 else "no", f"{r['strided_s'] * 1e3:.2f}",
                     f"{r['raw_s'] / r['strided_s']:.3f}", f"{r['inplace_s'] * 1e3:.2f}",
                     f"{r['into_s'] * 1e3:.2f}"])
    print(f"Ulysses exchange (q to head-parallel) vs the raw all-to-all of the same bytes, 2 ranks ({machine()}); "
          "median ms. 'exchange': q as the reference model writes it (grouped); 'strided': q as a "
          "(tokens, heads) projection; the norm's last multiply in place vs into the grouped buffer")
    print(table(["q MiB per rank", "raw all_to_all ms", "exchange ms", "raw / exchange", ">= 0.95", "strided ms",
                 "raw / strided", "multiply in place ms", "multiply into grouped ms"], rows))

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
    r = result(launch(2, __file__, "--rank-layouts"))
    print(f"Ulysses 2 on 2 ranks, interleaved: q, k, v grouped {r['grouped_s']:.3f} s, strided "
          f"{r['strided_s']:.3f} s, grouped / strided {r['grouped_s'] / r['strided_s']:.3f}")
    print()
    ring_main()


if __name__ == "__main__":
    if "--rank-ring-exchange" in sys.argv:
        rank_ring_exchange()
    elif "--rank-ring-time" in sys.argv:
        rank_ring_time()
    elif "--rank-exchange" in sys.argv:
        rank_exchange()
    elif "--rank-memory" in sys.argv:
        rank_forward("memory")
    elif "--rank-time" in sys.argv:
        rank_forward("time")
    elif "--rank-layouts" in sys.argv:
        rank_forward("layouts")
    else:
        main()
