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

Flux (``--flux``: this section alone; ``--runs N`` repeats it, each run with its own baseline):

- *flux time*: one transformer forward (a denoising step's call; Flux-dev is guidance-distilled,
  so one call a step) of a stock diffusers ``FluxTransformer2DModel`` with random weights,
  float32 (what diffusers builds on the CPU), ``FLUX`` below: Flux's head dim and rotary axes,
  4 heads, 2 double and 4 single blocks, at a 1024 x 1024 image (4096 image tokens) and 512
  text tokens. 1 rank with the model whole and no hsdp, against Ulysses 2 and ring 2 on 2
  ranks, each with hsdp sharding the blocks' weights over the same 2 ranks
  (``apply_hsdp_to_model`` + ``hsdp.parallel.context.apply_sequence_parallel_torch``). Threads:
  as the *time* section, the harness's launch environment, one thread per rank
  (``OMP_NUM_THREADS=1``: 2 ranks fill the 2 cores); 1 rank with 2 threads (torch's default
  here) is timed beside it, the bound a second core gives one process. Before each launch the
  section waits (30 s polls, 10 min at most) for the 1-minute load average to fall below 1.0
  and records it. Goal (issue 32): Ulysses 2 / 1 rank and ring 2 / 1 rank at most 0.6. Writes
  ``bench/records/bench_parallel_flux.json``.

    .venv/bin/python bench/bench_parallel.py
    .venv/bin/python bench/bench_parallel.py --ring
    .venv/bin/python bench/bench_parallel.py --flux --runs 3
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import MPI_ENV, interleaved, launch, machine, reset_peak_rss, table, vm_kib, wait_quiet  # noqa: E402

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


# Flux at real proportions, small enough for 2 cores: Flux's head dim 128 and rotary axes
# (16, 56, 56), its text width 4096 and pooled 768, its 64 packed latent channels (16 x 2 x 2);
# 4 heads (Flux: 24), 2 double-stream and 4 single-stream blocks (Flux: 19 and 38, the same 1:2)
FLUX = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=128,
            num_attention_heads=4, joint_attention_dim=4096, pooled_projection_dim=768, axes_dims_rope=(16, 56, 56))
# a 1024 x 1024 image: 128 x 128 latents packed 2 x 2, 64 x 64 = 4096 image tokens; Flux-dev's 512 text tokens
FLUX_TOKENS = dict(height=64, width=64, text=512)
FLUX_REPS = 5
# (label, ranks, torch threads per rank, sequence parallel)
FLUX_CASES = [("1 rank, whole", 1, 1, "none"), ("1 rank, whole", 1, 2, "none"),
              ("Ulysses 2 + HSDP 2", 2, 1, "ulysses"), ("ring 2 + HSDP 2", 2, 1, "ring")]
FLUX_RECORD = Path(__file__).resolve().parent / "records" / "bench_parallel_flux.json"


def is_flux_block(name: str, module: object) -> bool:
    """hsdp's units: each double- and single-stream block (as tests/torch_models.py shards Flux)."""
    return name.split(".")[0] in ("transformer_blocks", "single_transformer_blocks") and name.count(".") == 1


def flux_inputs() -> dict:
    import torch

    h, w, text = FLUX_TOKENS.values()
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(h, w, 3)  # as FluxPipeline._prepare_latent_image_ids: (0, row, column)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return {
        "hidden_states": torch.randn(1, h * w, FLUX["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(1, text, FLUX["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(1, FLUX["pooled_projection_dim"], generator=g),
        "timestep": torch.tensor([0.5]),
        "img_ids": img_ids.reshape(h * w, 3),
        "txt_ids": torch.zeros(text, 3),
        "return_dict": False,
    }


def arg(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


def rank_flux() -> None:
    import torch

    mode, threads, ref = arg("--rank-flux"), int(arg("--threads")), Path(arg("--ref"))
    torch.set_num_threads(threads)
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**FLUX).eval()
    rank, barrier = 0, (lambda: None)
    if mode != "none":  # hsdp shards the blocks over the world, and the tokens split over it
        import hsdp
        from hsdp import parallel
        from hsdp.parallel.context import apply_sequence_parallel_torch

        world = hsdp.distributed.init_process_group()
        rank, barrier = world.rank, world.barrier
        degree = {"ulysses_degree" if mode == "ulysses" else "ring_degree": world.size}
        groups = parallel.init_parallel_groups(hsdp.DiffusionParallelConfig(use_hsdp=True, **degree), world)
        model._hsdp_shard_conditions = [is_flux_block]
        hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))
        apply_sequence_parallel_torch(model, groups.sp)
    kw = flux_inputs()
    times = []
    with torch.inference_mode():
        out = model(**kw)[0]  # warm: allocator, oneDNN/BLAS buffers; hsdp records its prefetch order
        for _ in range(FLUX_REPS):
            barrier()
            t0 = time.perf_counter()
            model(**kw)
            times.append(time.perf_counter() - t0)
    if rank != 0:
        return
    res = {"threads": torch.get_num_threads(), "seconds": sorted(times)[len(times) // 2], "times": times,
           "dtype": str(out.dtype).removeprefix("torch.")}
    if mode == "none" and threads == 1:
        torch.save(out, ref)
    else:  # sanity: the output against the 1-rank, 1-thread one
        expect = torch.load(ref)
        diff = (out - expect).abs().max().item()
        res.update(max_abs_diff=diff, max_abs_ref=expect.abs().max().item(),
                   relative=diff / expect.abs().max().item())
    print("RESULT " + json.dumps(res))


def flux_main() -> None:
    import platform

    import diffusers
    import torch

    runs = int(arg("--runs")) if "--runs" in sys.argv else 1
    h, w, text = FLUX_TOKENS.values()
    config = (f"FluxTransformer2DModel, {FLUX['num_attention_heads']} heads x head dim {FLUX['attention_head_dim']} "
              f"(rotary axes {FLUX['axes_dims_rope']}), {FLUX['num_layers']} double + {FLUX['num_single_layers']} "
              f"single blocks, {h * w} image + {text} text tokens, float32, random weights")
    git = lambda *a: subprocess.run(["git", *a], cwd=Path(__file__).resolve().parent.parent,  # noqa: E731
                                    capture_output=True, text=True).stdout.strip()
    record = {"script": "bench_parallel", "section": "flux", "argv": sys.argv,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(),
              "commit": git("rev-parse", "HEAD"), "python_hsdp_uncommitted": git("status", "--porcelain", "python/hsdp"),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "diffusers": diffusers.__version__},
              "config": {"model": FLUX, "tokens": FLUX_TOKENS, "dtype": "float32", "reps": FLUX_REPS,
                         "statistic": "median of the reps after one warm-up forward, rank 0's clock"},
              "threads": "the harness's launch environment: OMP_NUM_THREADS=1 per rank (hsdp.launch's), "
                         "torch.set_num_threads(threads) in the rank; 'threads' in each row is "
                         "torch.get_num_threads() as the rank ran",
              "env": {k: v for k, v in MPI_ENV.items() if "THREADS" in k},
              "runs": []}
    print(f"Flux, one transformer forward ({machine()}): {config}; median of {FLUX_REPS} after a warm-up. "
          f"Threads: one per rank (the harness's OMP_NUM_THREADS=1), and 1 rank with 2")
    for run in range(runs):
        rows, results = [], []
        with tempfile.TemporaryDirectory() as tmp:
            ref = str(Path(tmp) / "out.pt")
            for label, ranks, threads, mode in FLUX_CASES:
                seen = wait_quiet()
                r = result(launch(ranks, __file__, "--rank-flux", mode, "--threads", str(threads), "--ref", ref))
                r.update(label=label, ranks=ranks, mode=mode, **seen,
                         load_after=[round(x, 2) for x in os.getloadavg()])
                results.append(r)
        base1 = results[0]["seconds"]
        base2 = results[1]["seconds"]
        for r in results:
            r["vs_1x1"], r["vs_1x2"] = r["seconds"] / base1, r["seconds"] / base2
            diff = f"{r['max_abs_diff']:.2e}" if "max_abs_diff" in r else "(reference)"
            rows.append([r["label"], f"{r['ranks']} x {r['threads']}", f"{r['seconds']:.3f}", f"{r['vs_1x1']:.3f}",
                         f"{r['vs_1x2']:.3f}", diff, f"{r['load_before'][0]:.2f}", f"{r['load_after'][0]:.2f}"])
        record["runs"].append(results)
        print(f"\nRun {run + 1} of {runs}")
        print(table(["run", "ranks x threads", "step s", "vs 1 rank x 1", "vs 1 rank x 2", "max abs diff",
                     "load before", "load after"], rows))
        FLUX_RECORD.parent.mkdir(exist_ok=True)
        FLUX_RECORD.write_text(json.dumps(record, indent=1) + "\n")
    summary = [[r["label"], f"{r['ranks']} x {r['threads']}",
                ", ".join(f"{run[i]['vs_1x1']:.3f}" for run in record["runs"]),
                ", ".join(f"{run[i]['vs_1x2']:.3f}" for run in record["runs"])]
               for i, r in enumerate(record["runs"][0])]
    print(f"\nStep time against 1 rank, {runs} run(s); goal: Ulysses 2 and ring 2 at most 0.6 of 1 rank")
    print(table(["run", "ranks x threads", "vs 1 rank x 1 thread", "vs 1 rank x 2 threads"], summary))
    print(f"record: {FLUX_RECORD.relative_to(Path(__file__).resolve().parent.parent)}")


def main() -> None:
    if "--flux" in sys.argv:
        flux_main()
        return
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
    if "--rank-flux" in sys.argv:
        rank_flux()
    elif "--rank-ring-exchange" in sys.argv:
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
