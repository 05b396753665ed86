"""Parallel VAE (issue 33): a stock diffusers ``AutoencoderKLWan``'s tiled decode on 2 ranks
(:class:`hsdp.pipelines.vae.TileSpread`) against the same tiled decode on 1 rank.

- *decode time*: ``vae.decode(z)`` with tiling on, the same tiles in every case. 1 rank: the
  stock tiled decode, no hsdp. 2 ranks: ``hsdp.distributed.init_process_group()``,
  ``TileSpread(vae, world, 2)``, ``vae.decode(z)`` on both ranks (tile t computed by rank
  t mod 2; rank 0, the writer, receives rank 1's tiles and runs the stock blend). Goal: 2 ranks
  at most 0.6 of 1 rank.
- *memory*: the peak resident set a rank gains during a decode (``malloc_trim(0)``, then
  ``reset_peak_rss()`` and VmRSS just before it, VmHWM just after: the heap pages an earlier
  decode freed go back first, so the gain is this decode's), for the 1-rank decode, the
  writer and the non-writer.
  Goal: the non-writer at most 0.6 of the 1-rank decode (it holds one tile's activations, not
  the tiles and the video).
- *exactness*: rank 0's video on 2 ranks against the 1-rank (1 thread) video, max abs
  difference and bit equality (the writer blends the very tiles a one-rank decode makes: 0).
- *transfers*: on 2 ranks, the seconds each rank spends inside TileSpread's ``_send`` (the
  non-writer) and ``_recv`` (the writer), timed by wrapping them on the instance: blocked on
  the other rank, or copying.

The VAE is ``VAE`` below, random weights (``torch.manual_seed(0)``), float32, under
``torch.inference_mode()``; the latent ``LATENT`` (standard normal, seed 1), the tiles ``TILES``
(``vae.enable_tiling(**TILES)``). Threads: the harness's launch environment gives each rank one
thread (``OMP_NUM_THREADS=1``, as ``hsdp.launch``): 2 ranks fill the 2 cores here, the baseline
is 1 rank x 1 thread; 1 rank x 2 threads (torch's default in a plain process here) is timed
beside it, the bound a second core gives one process. Before each launch the bench waits (30 s
polls, 10 min at most) for the 1-minute load average to fall below 1.0 and records it. Time:
median of ``REPS`` decodes after a warm-up decode, rank 0's clock, a barrier before each.
``--runs N`` repeats the whole comparison, each run with its own baseline. Writes
``bench/records/bench_vae.json``.

``--clean-memory`` (this section alone): the memory again, 1 rank and 2 ranks, one decode after
a warm-up, with glibc's mmap threshold fixed at 64 KiB (``CLEAN_MALLOC``) so the resident set
follows the live tensors; with the default allocator the heap's reuse moves a decode's peak by
100 MiB and more here. Slower (page faults): memory only. Writes
``bench/records/bench_vae_memory.json``.

    .venv/bin/python bench/bench_vae.py --runs 3
    .venv/bin/python bench/bench_vae.py --clean-memory
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import MPI_ENV, launch, machine, reset_peak_rss, table, vm_kib, wait_quiet  # noqa: E402

# The Wan 2.1 / 2.2 (14B) VAE's own architecture (diffusers' defaults for AutoencoderKLWan:
# base_dim 96, z_dim 16, dim_mult [1, 2, 4, 4], 2 res blocks, temporal downsampling in the
# last two stages), with base_dim 32 instead of 96: see BASE_DIM_WHY
VAE = dict(base_dim=32, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
BASE_DIM_WHY = ("one 128 x 128 tile of 17 video frames takes 26.9 s on one core here at base_dim 96 (the real "
                "width), 8.4 s at 48, 4.5 s at 32; the tiles below (7.9 such tiles' area) would take about 210 s "
                "per decode at 96 (about 27 min per run of 9 decodes), 66 s at 48 (9 min), 35 s at 32 (4.5 min)")
# 5 latent frames = 17 video frames (1 + 4 x 4), 32 x 48 latents = 256 x 384 pixels
LATENT = dict(frames=5, height=32, width=48)
# 160 x 160 pixel tiles (20 x 20 latents) every 128 pixels (16 latents): 2 rows x 3 columns, the
# last row and column 16 latents (128 px). Not Wan's default shape (256 every 192, whose partial
# tiles are 12 latents or less): tiles 8 or 12 latents high decode at about twice the time per
# pixel here (oneDNN's 3-D convolutions), 16, 20 and 24 at the same
TILES = dict(tile_sample_min_height=160, tile_sample_min_width=160,
             tile_sample_stride_height=128, tile_sample_stride_width=128)
REPS = 2
# (label, ranks, torch threads per rank, mode)
CASES = [("1 rank, stock tiled decode", 1, 1, "stock"), ("1 rank, stock tiled decode", 1, 2, "stock"),
         ("2 ranks, TileSpread", 2, 1, "spread")]
# [Note: interleaved] This machine's speed drifts by 20% and more between launches minutes apart
# (measured: the same 1-rank decode 32.5 s in one launch, 39.5 s in another). So the ratio is taken
# inside one 2-rank launch, rep by rep: rank 0 alone runs the stock tiled decode (rank 1 waits at
# a barrier), then both run TileSpread, then both run the whole stock decode at once (no hsdp
# traffic). [the bound] Two processes on the two cores run slower each than one alone (shared
# caches and memory bandwidth): the third over the first is that slowdown c, and c x (the
# largest rank's share of the tiles' area) is the least 2 ranks can take here. The separate
# launches (1 rank x 1 and x 2 threads, no hsdp) give the reference video, the 1-rank memory
# and the second core's gain to one process.
RECORD = Path(__file__).resolve().parent / "records" / "bench_vae.json"
SCALE = 8  # AutoencoderKLWan's spatial compression


def tiles() -> list[tuple[int, int]]:
    """The stock loop's tiles in its order, as (latent rows, latent columns) each."""
    lh, lw = TILES["tile_sample_min_height"] // SCALE, TILES["tile_sample_min_width"] // SCALE
    sh, sw = TILES["tile_sample_stride_height"] // SCALE, TILES["tile_sample_stride_width"] // SCALE
    h, w = LATENT["height"], LATENT["width"]
    return [(min(lh, h - i), min(lw, w - j)) for i in range(0, h, sh) for j in range(0, w, sw)]


def timed(fn, total: list[float]):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t0
    return wrapper


def arg(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


def make_vae():
    """The bench's VAE: VAE's architecture, seed 0, TILES switched on."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**VAE).eval()
    vae.enable_tiling(**TILES)
    return vae


def rank_vae() -> None:
    import numpy as np
    import torch

    mode, threads, ref = arg("--rank-vae"), int(arg("--threads")), Path(arg("--ref"))
    reps = int(arg("--reps")) if "--reps" in sys.argv else REPS
    if "--latent-frames" in sys.argv:
        LATENT["frames"] = int(arg("--latent-frames"))
    torch.set_num_threads(threads)

    vae = make_vae()
    z = torch.randn(1, VAE["z_dim"], *LATENT.values(), generator=torch.Generator().manual_seed(1))
    world, spread, rank, barrier = None, None, 0, (lambda: None)
    waited = [0.0]  # seconds this rank spent in TileSpread's transfers (blocked on the other rank, or copying)
    if mode == "spread":
        import hsdp
        from hsdp.pipelines.vae import TileSpread

        world = hsdp.distributed.init_process_group()
        rank, barrier = world.rank, world.barrier
        spread = TileSpread(vae, world, world.size)
        # timed on the instance (the library's own methods run): the non-writer's sends and marks;
        # the writer receives on a thread of its own while it decodes (nothing of it to time here)
        for name in ("_send", "_mark"):
            setattr(spread, name, timed(getattr(spread, name), waited))
    libc = ctypes.CDLL(None)
    times, gains, before, waits = [], [], [], []
    with torch.inference_mode():
        for rep in range(reps + 1):  # the first: the warm-up (allocator, oneDNN primitives), not timed
            # freed heap pages go back to the system, so the RSS before is what lives (the model,
            # z) and the gain is what this decode touches, not what an earlier one left mapped
            libc.malloc_trim(0)
            barrier()
            base = vm_kib("VmRSS")
            reset_peak_rss()
            waited[0] = 0.0
            t0 = time.perf_counter()
            out = vae.decode(z).sample
            dt = time.perf_counter() - t0
            gains.append(vm_kib("VmHWM") - base)
            before.append(base)
            waits.append(waited[0])
            if rep:
                times.append(dt)
            if rep < reps:
                del out
    mine = np.array(gains + before + [round(w * 1e6) for w in waits], dtype=np.int64)
    if world is not None:
        every = np.zeros((world.size, mine.size), dtype=np.int64)
        world.all_gather(mine, every)
    else:
        every = mine[None]
    if rank != 0:
        return
    n = reps + 1
    res = {"threads": torch.get_num_threads(), "seconds": statistics.median(times), "times": times,
           "shape": list(out.shape), "dtype": str(out.dtype).removeprefix("torch."),
           # per rank (0 = the writer), per decode (the first: the warm-up), KiB
           "rss_gain_kib": every[:, :n].tolist(), "rss_before_kib": every[:, n:2 * n].tolist()}
    if spread is not None:
        res["tiles"] = spread.last
        res["spread"] = spread.spread()
        # per rank, per decode: seconds inside TileSpread's sends (rank 1) and receives (the writer)
        res["transfer_s"] = (every[:, 2 * n:] / 1e6).tolist()
    res["malloc_mmap_threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if mode == "stock" and threads == 1:
        torch.save(out, ref)
    else:  # exactness: the video against the 1-rank, 1-thread one
        expect = torch.load(ref)
        res.update(max_abs_diff=(out - expect).abs().max().item(), equal=bool(torch.equal(out, expect)),
                   max_abs_ref=expect.abs().max().item())
    print("RESULT " + json.dumps(res))


def rank_interleaved() -> None:
    """One 2-rank launch: per rep, alone (rank 0's stock decode), spread (TileSpread on both),
    both (the stock decode on both at once); [Note: interleaved]. Rank 0 prints the medians."""
    import torch

    import hsdp
    from hsdp.pipelines.vae import TileSpread

    ref, reps = Path(arg("--ref")), int(arg("--reps")) if "--reps" in sys.argv else REPS + 1
    torch.set_num_threads(1)
    world = hsdp.distributed.init_process_group()

    stock, spread_vae = make_vae(), make_vae()
    spread = TileSpread(spread_vae, world, world.size)
    z = torch.randn(1, VAE["z_dim"], *LATENT.values(), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {"alone": [], "spread": [], "both": []}
    out = None
    with torch.inference_mode():
        for rep in range(reps + 1):  # the first: the warm-up of each
            for case in times:
                world.barrier()
                t0 = time.perf_counter()
                if case == "spread":
                    out = spread_vae.decode(z).sample
                elif case == "both" or world.rank == 0:
                    stock.decode(z)
                dt = time.perf_counter() - t0
                if rep:
                    times[case].append(dt)
    world.barrier()
    if world.rank != 0:
        return
    expect = torch.load(ref)
    res = {"times": times, "seconds": {k: statistics.median(v) for k, v in times.items()}, "tiles": spread.last,
           "spread": spread.spread(), "max_abs_diff": (out - expect).abs().max().item(),
           "equal": bool(torch.equal(out, expect))}
    print("RESULT " + json.dumps(res))


def result(lines: str) -> dict:
    return json.loads(next(line for line in lines.splitlines() if line.startswith("RESULT "))[7:])


def mib(kib: float) -> str:
    return f"{kib / 1024:.0f}"


def describe() -> tuple[str, dict]:
    """The configuration in words, and the record's common fields."""
    import diffusers
    import torch

    shape = tiles()
    from hsdp.pipelines.vae import deal

    dealt = deal([h * w for h, w in shape], 2)  # TileSpread's owners ([Note: tiles by cost])
    owners = [[t for k, t in enumerate(shape) if dealt[k] == r] for r in range(2)]
    area = [sum(h * w for h, w in o) for o in owners]
    frames = 1 + 4 * (LATENT["frames"] - 1)
    config = (f"AutoencoderKLWan {VAE}, random weights, float32; latent {LATENT['frames']} x {LATENT['height']} x "
              f"{LATENT['width']} (video {frames} x {LATENT['height'] * SCALE} x {LATENT['width'] * SCALE}); "
              f"tiles {TILES['tile_sample_min_height']} px every {TILES['tile_sample_stride_height']} px: {len(shape)} "
              f"tiles, {len(owners[0])} + {len(owners[1])} by tile, {area[0]} + {area[1]} latent pixels "
              f"(rank 0's share {area[0] / sum(area):.3f}, the largest {max(area) / sum(area):.3f})")
    git = lambda *a: subprocess.run(["git", *a], cwd=Path(__file__).resolve().parent.parent,  # noqa: E731
                                    capture_output=True, text=True).stdout.strip()
    record = {"script": "bench_vae", "argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": machine(), "commit": git("rev-parse", "HEAD"),
              "python_hsdp_uncommitted": git("status", "--porcelain", "python/hsdp"),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "diffusers": diffusers.__version__},
              "config": {"vae": VAE, "base_dim_why": BASE_DIM_WHY, "latent": LATENT, "video_frames": frames,
                         "tiles": TILES, "tile_shapes_latent": shape, "tiles_by_rank": [len(o) for o in owners],
                         "latent_area_by_rank": area, "largest_share": max(area) / sum(area),
                         "bound_why": "[the bound] in bench_vae.py", "dtype": "float32", "reps": REPS,
                         "statistic": "median of the reps after one warm-up decode, rank 0's clock",
                         "memory": "per rank, per decode (the first is the warm-up): malloc_trim(0), then "
                                   "VmHWM after minus VmRSS before, reset_peak_rss() just before the decode; KiB"},
              "threads": "the harness's launch environment: OMP_NUM_THREADS=1 per rank (hsdp.launch's), "
                         "torch.set_num_threads(threads) in the rank; 'threads' in each row is "
                         "torch.get_num_threads() as the rank ran",
              "env": {k: v for k, v in MPI_ENV.items() if "THREADS" in k}}
    return config, record


def main() -> None:
    global RECORD
    runs = int(arg("--runs")) if "--runs" in sys.argv else 1
    if "--record" in sys.argv:  # another record than the default's (a rerun kept beside the first)
        RECORD = Path(arg("--record")).resolve()
    config, record = describe()
    record["runs"] = []
    print(f"Parallel VAE, one tiled decode ({machine()}): {config}; median of {REPS} after a warm-up. "
          f"Threads: one per rank (the harness's OMP_NUM_THREADS=1), and 1 rank with 2", flush=True)
    for run in range(runs):
        results = []
        with tempfile.TemporaryDirectory() as tmp:
            ref = str(Path(tmp) / "video.pt")
            for label, ranks, threads, mode in CASES:
                seen = wait_quiet()
                t0 = time.monotonic()
                r = result(launch(ranks, __file__, "--rank-vae", mode, "--threads", str(threads), "--ref", ref))
                r.update(label=label, ranks=ranks, mode=mode, **seen, launch_s=round(time.monotonic() - t0),
                         load_after=[round(x, 2) for x in os.getloadavg()])
                # the timed decodes' largest gain per rank (the warm-up's apart)
                r["gain_kib"] = [max(g[1:]) for g in r["rss_gain_kib"]]
                r["warmup_gain_kib"] = [g[0] for g in r["rss_gain_kib"]]
                if "transfer_s" in r:  # the timed decodes' median, per rank
                    r["transfer_median_s"] = [statistics.median(t[1:]) for t in r["transfer_s"]]
                results.append(r)
                print(f"  {label}, {ranks} x {r['threads']}: {r['seconds']:.2f} s ({launch_s_str(r)})", flush=True)
            seen = wait_quiet()
            t0 = time.monotonic()
            inter = result(launch(2, __file__, "--rank-interleaved", "--ref", ref))
            inter.update(**seen, launch_s=round(time.monotonic() - t0), load_after=[round(x, 2) for x in os.getloadavg()])
        base1, base2, spread = results
        for r in results:
            r["vs_1x1"], r["vs_1x2"] = r["seconds"] / base1["seconds"], r["seconds"] / base2["seconds"]
        sec = inter["seconds"]
        share = max(inter["tiles"]["area_share"])
        slowdown = sec["both"] / sec["alone"]
        bound = {"spread_vs_alone": sec["spread"] / sec["alone"], "slowdown": slowdown, "largest_share": share,
                 "bound_vs_alone": slowdown * share, "spread_vs_bound": sec["spread"] / sec["alone"] / (slowdown * share),
                 "interleaved": inter}
        mem = {"stock_1x1_kib": base1["gain_kib"][0], "writer_kib": spread["gain_kib"][0],
               "non_writer_kib": spread["gain_kib"][1],
               "warmup_stock_1x1_kib": base1["warmup_gain_kib"][0], "warmup_writer_kib": spread["warmup_gain_kib"][0],
               "warmup_non_writer_kib": spread["warmup_gain_kib"][1]}
        mem["non_writer_vs_1"] = mem["non_writer_kib"] / mem["stock_1x1_kib"]
        mem["writer_vs_1"] = mem["writer_kib"] / mem["stock_1x1_kib"]
        mem["warmup_non_writer_vs_1"] = mem["warmup_non_writer_kib"] / mem["warmup_stock_1x1_kib"]
        record["runs"].append({"cases": results, "memory": mem, "bound": bound})
        rows = []
        for r in results:
            diff = f"{r['max_abs_diff']:.1e} ({'equal' if r['equal'] else 'differs'})" if "max_abs_diff" in r \
                else "(reference)"
            rows.append([r["label"], f"{r['ranks']} x {r['threads']}", f"{r['seconds']:.2f}", f"{r['vs_1x1']:.3f}",
                         f"{r['vs_1x2']:.3f}", diff, f"{r['load_before'][0]:.2f}", f"{r['load_after'][0]:.2f}"])
        print(f"\nRun {run + 1} of {runs}: decode time")
        print(table(["decode", "ranks x threads", "decode s", "vs 1 rank x 1", "vs 1 rank x 2", "max abs diff",
                     "load before", "load after"], rows))
        print(f"Interleaved in one 2-rank launch ([Note: interleaved]; medians of {len(inter['times']['alone'])}): "
              f"rank 0 alone {sec['alone']:.2f} s, TileSpread {sec['spread']:.2f} s, both ranks the whole decode at once "
              f"{sec['both']:.2f} s. TileSpread / alone {bound['spread_vs_alone']:.3f}; the bound: slowdown "
              f"{slowdown:.3f} x largest share {share:.3f} = {bound['bound_vs_alone']:.3f}; TileSpread "
              f"{bound['spread_vs_bound']:.3f} x the bound; max abs diff {inter['max_abs_diff']:.1e}")
        w = spread["transfer_median_s"]
        print(f"{spread['spread']}; inside TileSpread's transfers (median of the timed decodes): the non-writer "
              f"{w[1]:.2f} s sending, of {spread['seconds']:.2f} s (the writer receives on a thread while it "
              "decodes)")
        print("Peak RSS gained during a decode, MiB (timed decodes' largest; the warm-up decode's in brackets)")
        print(table(["1 rank x 1", "writer (2 ranks)", "non-writer (2 ranks)", "non-writer / 1 rank",
                     "writer / 1 rank"],
                    [[f"{mib(mem['stock_1x1_kib'])} ({mib(mem['warmup_stock_1x1_kib'])})",
                      f"{mib(mem['writer_kib'])} ({mib(mem['warmup_writer_kib'])})",
                      f"{mib(mem['non_writer_kib'])} ({mib(mem['warmup_non_writer_kib'])})",
                      f"{mem['non_writer_vs_1']:.3f} ({mem['warmup_non_writer_vs_1']:.3f})",
                      f"{mem['writer_vs_1']:.3f}"]]), flush=True)
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nSummary, {runs} run(s); goals: 2 ranks at most 0.6 of 1 rank's decode time, the non-writer's peak "
          "RSS gain at most 0.6 of 1 rank's")
    print(table(["run", "2 ranks / alone (one launch)", "bound", "2 ranks / bound", "2 ranks / 1 rank x 1 (launches)",
                 "2 ranks / 1 rank x 2", "1 rank x 2 / x 1", "non-writer / 1 rank", "writer / 1 rank", "max abs diff"],
                [[k + 1, f"{run['bound']['spread_vs_alone']:.3f}", f"{run['bound']['bound_vs_alone']:.3f}",
                  f"{run['bound']['spread_vs_bound']:.3f}", f"{run['cases'][2]['vs_1x1']:.3f}",
                  f"{run['cases'][2]['vs_1x2']:.3f}",
                  f"{run['cases'][1]['vs_1x1']:.3f}", f"{run['memory']['non_writer_vs_1']:.3f}",
                  f"{run['memory']['writer_vs_1']:.3f}", f"{run['cases'][2]['max_abs_diff']:.1e}"]
                 for k, run in enumerate(record["runs"])]))
    print(f"record: {RECORD.relative_to(Path(__file__).resolve().parent.parent)}")


# glibc's malloc with a fixed mmap threshold: every block of 64 KiB or more is its own mapping,
# unmapped when freed, so the resident set follows the live tensors (the default threshold
# rises to 32 MiB as blocks are freed, and the heap's reuse and fragmentation move the peak by
# 100 MiB and more between decodes here). Page faults on every large tensor make a decode about
# 1.7x slower here: memory only, never timed
CLEAN_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
MEMORY_RECORD = Path(__file__).resolve().parent / "records" / "bench_vae_memory.json"


# The memory section's video: 81 frames (Wan's default length), not 17. A rank's decode holds one
# tile's activations (the decoder runs a latent frame at a time: the same at any length) plus the
# tiles it keeps: the 1-rank decode keeps every tile and the blended video, the non-writer one tile.
# At 17 frames the tiles are 20 MiB against about 400 MiB of one tile's activations, so the two
# peaks differ by little more than allocator noise; at 81 frames the kept tiles are what a long
# video costs.
MEMORY_LATENT_FRAMES = 21


def memory_main() -> None:
    """--clean-memory: the peak RSS gains again, with CLEAN_MALLOC, one decode after a warm-up, of
    the longer video MEMORY_LATENT_FRAMES."""
    LATENT["frames"] = MEMORY_LATENT_FRAMES
    config, record = describe()
    record.update(section="clean-memory", malloc_env=CLEAN_MALLOC, cases=[])
    record["config"]["reps"] = 1
    print(f"Parallel VAE, peak RSS gained during one tiled decode with {CLEAN_MALLOC} (the resident set "
          f"follows the live tensors), ({machine()}): {config}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        ref = str(Path(tmp) / "video.pt")
        for label, ranks, threads, mode in (CASES[0], CASES[2]):
            os.environ.update(CLEAN_MALLOC)
            try:
                wait_quiet()
                r = result(launch(ranks, __file__, "--rank-vae", mode, "--threads", str(threads), "--ref", ref,
                                  "--reps", "1", "--latent-frames", str(MEMORY_LATENT_FRAMES)))
            finally:
                for k in CLEAN_MALLOC:
                    del os.environ[k]
            r.update(label=label, ranks=ranks, mode=mode)
            record["cases"].append(r)
    stock, spread = record["cases"]
    one, writer, other = stock["rss_gain_kib"][0][1], spread["rss_gain_kib"][0][1], spread["rss_gain_kib"][1][1]
    record["memory"] = {"stock_1x1_kib": one, "writer_kib": writer, "non_writer_kib": other,
                        "non_writer_vs_1": other / one, "writer_vs_1": writer / one,
                        "warmup_kib": [stock["rss_gain_kib"][0][0], *(g[0] for g in spread["rss_gain_kib"])]}
    MEMORY_RECORD.parent.mkdir(exist_ok=True)
    MEMORY_RECORD.write_text(json.dumps(record, indent=1) + "\n")
    w = record["memory"]["warmup_kib"]
    print(table(["1 rank x 1", "writer (2 ranks)", "non-writer (2 ranks)", "non-writer / 1 rank", "writer / 1 rank",
                 "max abs diff"],
                [[f"{mib(one)} ({mib(w[0])})", f"{mib(writer)} ({mib(w[1])})", f"{mib(other)} ({mib(w[2])})",
                  f"{other / one:.3f}", f"{writer / one:.3f}", f"{spread['max_abs_diff']:.1e}"]]))
    print("MiB; the warm-up decode's in brackets. Decode seconds (not comparable: page faults): "
          f"1 rank {stock['seconds']:.1f}, 2 ranks {spread['seconds']:.1f}")
    print(f"record: {MEMORY_RECORD.relative_to(Path(__file__).resolve().parent.parent)}")


def launch_s_str(r: dict) -> str:
    return f"launch {r['launch_s']} s, load {r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f}"


if __name__ == "__main__":
    if "--rank-vae" in sys.argv:
        rank_vae()
    elif "--rank-interleaved" in sys.argv:
        rank_interleaved()
    elif "--clean-memory" in sys.argv:
        memory_main()
    else:
        main()
