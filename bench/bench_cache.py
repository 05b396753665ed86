"""Step caches: first-block cache's speed-up on 2 ranks (HSDP 1x2, Ulysses 2) next to its
speed-up in one process, on the same folder, call and threshold.

    .venv/bin/python bench/bench_cache.py [--threshold 0.2] [--steps 10] [--runs 2] [--record PATH]

The pipeline folder is bench_pipeline.py's Wan2.2-style one (two transformer experts of
``--heads`` x 64 width and ``--layers`` blocks, tiny_pipeline's text encoder and VAE; float32
on disk), the one bench_dp.py uses. Three layouts, each one launch (``harness.launch``):

- **1 process**: ``hsdp.pipelines.load_pipeline(folder, None)``: one process, the whole
  weights, no sharding (hsdp's cache watch counts the forwards; the decision is first-block
  cache's own statistic);
- **HSDP 1x2**: 2 ranks, ``DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=2)``;
- **Ulysses 2**: 2 ranks, ``DiffusionParallelConfig(use_hsdp=True, ulysses_degree=2)``
  (the weights sharded over the 2 ranks as well).

Every launch loads the folder in float32, then calls ``hsdp.pipelines.generate`` (the same
prompt, negative prompt, seed, size and steps; classifier-free guidance on, Wan's default 5.0;
``output_type="latent"``: the denoising loop, which the cache acts on, without the VAE
decode, which it does not) with no cache and with first-block cache, enabled as a user
would: ``for m in (pipe.transformer, pipe.transformer_2): m.enable_cache(FirstBlockCacheConfig(threshold=T))``
(and ``m.disable_cache()`` for the calls without). One warm-up call of each kind, then
``--reps`` calls of each, interleaved (none, cache / cache, none, ...); the time is the whole
``generate`` call on rank 0 between two barriers, the figure the median. speed-up = t(none) /
t(cache) per layout; the verdict compares each 2-rank layout's speed-up with the 1-process
one (within 10%). Each rank runs one torch thread (OMP_NUM_THREADS=1, the harness's
environment), the 1-process case too. Before each launch the driver waits for the machine to
be quiet: no other ``bench_*.py`` running, and the 1-minute load below ``--quiet-load``
(polled every 30 s, at most 10 minutes); the loads are recorded. While a launch runs the
driver looks every second for another benchmark and measures the CPU time the processes
outside this bench used (the machine's busy time less this bench's tree); a launch that
shared the machine (another benchmark seen, or others using more than ``--max-others`` cores
on average) is recorded as discarded and measured again.

Every cached call reports each transformer's computed and skipped forwards
(``pipeline_state(pipe).caches[name].counts``; cond and uncond are a forward each); they
must be the same in every call and every layout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import make_folder  # noqa: E402
from harness import ROOT, launch, machine, table  # noqa: E402

PROMPT = "a red fish swimming in the river"
LAYOUTS = {  # name -> (ranks, label)
    "single": (1, "1 process"),
    "hsdp": (2, "HSDP 1x2"),
    "ulysses": (2, "Ulysses 2"),
}


# ----------------------------------------------------------------------------- a launch


def worker(layout: str, folder: str, args: argparse.Namespace) -> None:
    import torch
    from diffusers import FirstBlockCacheConfig

    import hsdp.pipelines as hp
    from hsdp.engine.config import DiffusionParallelConfig
    from hsdp.world.distributed import init_process_group

    world = init_process_group()
    config = {"single": None,
              "hsdp": DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=2),
              "ulysses": DiffusionParallelConfig(use_hsdp=True, ulysses_degree=2)}[layout]
    pipe = hp.load_pipeline(folder, config, torch_dtype=getattr(torch, args.dtype), progress=False)
    pipe.set_progress_bar_config(disable=True)
    state = hp.pipeline_state(pipe)
    models = (pipe.transformer, pipe.transformer_2)
    # disable_cache drops the hooks; hsdp's watch knows hooks by id(), so the old ones are
    # kept alive here: a new hook can never take a freed one's id (and be taken as seen)
    retired: list[Any] = []
    stamps: list[list[Any]] = []  # (wall-clock start, kind, seconds) of every call, for the record
    call = dict(prompt=PROMPT, negative_prompt="blurry", height=args.size, width=args.size, num_frames=args.frames,
                num_inference_steps=args.steps, output_type="latent")

    def use(cached: bool) -> None:
        for m in models:
            if m._cache_config is not None:
                retired.extend(h for _, mod in m.named_modules() if getattr(mod, "_diffusers_hook", None)
                               for h in mod._diffusers_hook.hooks.values())
                m.disable_cache()
            if cached:
                m.enable_cache(FirstBlockCacheConfig(threshold=args.threshold))

    def once(cached: bool) -> tuple[float, dict[str, dict[str, int]], Any]:
        use(cached)
        for w in state.caches.values():
            w.counts.reset()
        world.barrier()
        t0 = time.perf_counter()
        out = hp.generate(pipe, generator=torch.Generator().manual_seed(0), **call)
        world.barrier()
        seconds = time.perf_counter() - t0
        stamps.append([round(time.time() - seconds, 1), "cache" if cached else "none", round(seconds, 3)])
        if cached:  # every first-block head hook decided by hsdp's reduced statistic (the watch found it)
            for m in models:
                heads = [h for _, mod in m.named_modules() if getattr(mod, "_diffusers_hook", None)
                         for h in mod._diffusers_hook.hooks.values() if type(h).__name__ == "FBCHeadBlockHook"]
                assert heads and all(hasattr(h._should_compute_remaining_blocks, "__wrapped__") for h in heads)
        counts = {name: w.counts.as_dict() for name, w in state.caches.items()}
        return seconds, counts, out

    record: dict[str, Any] = {"rank": world.rank, "ranks": world.size, "torch_threads": torch.get_num_threads(),
                              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                              "warmup": {}, "none": [], "cache": [], "counts_none": [], "counts_cache": []}
    for cached in (False, True):  # warm-up: each kind once (the first records the prefetch order)
        seconds, counts, _ = once(cached)
        record["warmup"]["cache" if cached else "none"] = {"seconds": seconds, "counts": counts}
    outs = {}
    for rep in range(args.reps):
        for cached in ((False, True) if rep % 2 == 0 else (True, False)):
            seconds, counts, out = once(cached)
            kind = "cache" if cached else "none"
            record[kind].append(seconds)
            record[f"counts_{kind}"].append(counts)
            outs[kind] = out
    if world.rank == 0:
        for kind, out in outs.items():
            torch.save(out.frames.detach().to(torch.float32).clone(), Path(args.out, f"latents_{kind}.pt"))
    record["calls"] = stamps
    Path(args.out, f"{world.rank}.json").write_text(json.dumps(record))


# ----------------------------------------------------------------------------- the driver


def _others() -> list[str]:
    """Command lines of other benchmarks running now (bench/bench_*.py but this one)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            argv = Path("/proc", pid, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        names = [os.path.basename(a.decode(errors="replace")) for a in argv]
        if any(n.startswith("bench_") and n.endswith(".py") and n != "bench_cache.py" for n in names):
            found.append(f"{pid}: " + " ".join(a.decode(errors="replace") for a in argv if a))
    return found


def _busy_ticks() -> int:
    """The machine's busy CPU time (clock ticks, every core) since boot: /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return user + nice + system + irq + softirq + steal


def _tree_ticks(root: int) -> dict[int, int]:
    """CPU ticks (own and reaped children's) of `root` and every process under it."""
    stats: dict[int, tuple[int, int]] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                fields = Path("/proc", pid, "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            stats[int(pid)] = (int(fields[1]), sum(map(int, fields[11:15])))  # ppid; utime stime cutime cstime
    mine, todo = {root}, [root]
    while todo:
        parent = todo.pop()
        kids = [p for p, (pp, _) in stats.items() if pp == parent and p not in mine]
        mine.update(kids)
        todo.extend(kids)
    return {p: stats[p][1] for p in mine if p in stats}


class Monitor:
    """While a launch runs: other benchmarks seen, and the CPU time every process outside
    this driver's tree used (the machine's busy time less this tree's), in cores on average."""

    def __init__(self, every: float = 1.0) -> None:
        self.every, self.seen, self.stop = every, [], threading.Event()
        self.mine_end: dict[int, int] = {}  # the highest ticks seen of each process of this tree
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = self.mine_end
        while not self.stop.wait(self.every):
            self.seen.extend(_others()[:1])
            for pid, ticks in _tree_ticks(os.getpid()).items():
                last[pid] = max(ticks, last.get(pid, 0))

    def __enter__(self) -> Monitor:
        self.t0, self.busy0 = time.monotonic(), _busy_ticks()
        self.mine0 = sum(_tree_ticks(os.getpid()).values())
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        hz = os.sysconf("SC_CLK_TCK")
        busy = _busy_ticks() - self.busy0
        mine = max(sum(self.mine_end.values()), sum(_tree_ticks(os.getpid()).values())) - self.mine0
        self.seconds = time.monotonic() - self.t0
        self.others_cores = max(0.0, (busy - mine) / hz / self.seconds)
        self.mine_cores = mine / hz / self.seconds


def wait_quiet(limit: float, poll: float, max_wait: float) -> dict[str, Any]:
    """Waits for no other benchmark (as long as it takes) and a 1-minute load below `limit`
    (at most `max_wait` seconds); returns the loads seen."""
    t0 = time.monotonic()
    loads: list[float] = []
    others_seen = False
    while True:
        others = _others()
        load = os.getloadavg()[0]
        loads.append(round(load, 2))
        if others:
            if not others_seen:
                print(f"  waiting: another benchmark is running ({others[0]})", file=sys.stderr, flush=True)
            others_seen = True
            t_load = time.monotonic()  # the load's 10 minutes start once the others are gone
        elif load < limit:
            return {"loads": loads, "waited_s": round(time.monotonic() - t0), "quiet": True,
                    "waited_for_other_bench": others_seen}
        elif time.monotonic() - (t_load if others_seen else t0) >= max_wait:
            return {"loads": loads, "waited_s": round(time.monotonic() - t0), "quiet": False,
                    "waited_for_other_bench": others_seen}
        time.sleep(poll)


def run_layout(layout: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    n, label = LAYOUTS[layout]
    discarded: list[dict[str, Any]] = []
    while True:
        quiet = wait_quiet(args.quiet_load, args.poll, args.max_wait)
        print(f"  {label}: 1-min load {quiet['loads'][-1]} (waited {quiet['waited_s']} s)", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="hsdp-bench-cache-") as out:
            with Monitor() as mon:
                launch(n, __file__, "--worker", layout, "--folder", str(folder), "--threshold", str(args.threshold),
                       "--steps", str(args.steps), "--frames", str(args.frames), "--size", str(args.size),
                       "--dtype", args.dtype, "--reps", str(args.reps), "--out", out, timeout=3600)
            wall = mon.seconds
            ranks = sorted((json.loads(f.read_text()) for f in Path(out).glob("*.json")), key=lambda r: r["rank"])
            latents = {k: torch.load(Path(out, f"latents_{k}.pt")) for k in ("none", "cache")}
        busy = {"others_cores": round(mon.others_cores, 3), "this_bench_cores": round(mon.mine_cores, 3)}
        print(f"  {label}: {wall:.0f} s; CPU of this bench {mon.mine_cores:.2f} cores, of other processes "
              f"{mon.others_cores:.2f}", file=sys.stderr, flush=True)
        seen = mon.seen or (["other processes used %.2f cores on average" % mon.others_cores]
                            if mon.others_cores > args.max_others else [])
        if not seen:
            break
        # something else shared the cores: this launch's times are not this layout's; again
        print(f"  {label}: not alone ({seen[0]}); measuring again", file=sys.stderr, flush=True)
        discarded.append({"why": seen[0], "cpu": busy, "quiet": quiet, "seconds_none": ranks[0]["none"],
                          "seconds_cache": ranks[0]["cache"]})
        if len(discarded) >= args.attempts:
            raise SystemExit(f"{label}: not alone in {len(discarded)} launches in a row ({seen[0]}); giving up")
    r0 = ranks[0]
    counts = [c for r in ranks for c in r["counts_cache"]] + [r["warmup"]["cache"]["counts"] for r in ranks]
    same = all(c == counts[0] for c in counts)
    none_counts = [c for r in ranks for c in r["counts_none"]]
    t_none, t_cache = statistics.median(r0["none"]), statistics.median(r0["cache"])
    return {
        "layout": label, "ranks": n, "launch_wall_s": round(wall, 1), "quiet": quiet, "cpu_during_launch": busy,
        "load_after_launch": [round(x, 2) for x in os.getloadavg()], "discarded_launches": discarded,
        "torch_threads": [r["torch_threads"] for r in ranks], "omp_num_threads": [r["omp_num_threads"] for r in ranks],
        "seconds_none": [round(s, 3) for s in r0["none"]], "seconds_cache": [round(s, 3) for s in r0["cache"]],
        "warmup_seconds": {k: round(v["seconds"], 3) for k, v in r0["warmup"].items()},
        "calls_rank0": r0["calls"],
        "median_none": round(t_none, 3), "median_cache": round(t_cache, 3), "speedup": round(t_none / t_cache, 4),
        "counts": counts[0], "counts_same_every_call_and_rank": same,
        "counts_without_cache": none_counts[0],  # the watch counts nothing when no cache is on
        "_latents": latents,
    }


def one_run(folder: Path, args: argparse.Namespace, index: int) -> dict[str, Any]:
    print(f"run {index}", file=sys.stderr, flush=True)
    res = {layout: run_layout(layout, folder, args) for layout in LAYOUTS}
    ref = res["single"]
    lat = {layout: r.pop("_latents") for layout, r in res.items()}
    for layout, r in res.items():
        # the same call on the same weights: how far each layout's latents are from one process's
        r["max_abs_diff_vs_1_process"] = {k: float((lat[layout][k] - lat["single"][k]).abs().max())
                                          for k in ("none", "cache")}
        r["latents_cache_vs_none_max_abs"] = float((lat[layout]["cache"] - lat[layout]["none"]).abs().max())
    s1 = ref["speedup"]
    verdicts = {}
    for layout in ("hsdp", "ulysses"):
        ratio = res[layout]["speedup"] / s1
        verdicts[layout] = {"ratio_to_1_process": round(ratio, 4), "within_10pct": abs(ratio - 1) <= 0.10,
                            "counts_equal_to_1_process": res[layout]["counts"] == ref["counts"]}
    return {"run": index, "layouts": res, "verdicts": verdicts}


def _library() -> dict[str, Any]:
    """The commit the bench ran at, and the uncommitted changes under python/ then."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted_under_python": git("status", "--short", "--", "python").splitlines()}


def _count_str(c: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{n}: {v['computed']}/{v['skipped']}" for n, v in c.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threshold", type=float, default=0.2, help="first-block cache threshold (default %(default)s)")
    p.add_argument("--heads", type=int, default=8, help="attention heads of 64 (default %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="blocks per transformer (default %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="denoising steps (default %(default)s)")
    p.add_argument("--frames", type=int, default=21, help="video frames (default %(default)s)")
    p.add_argument("--size", type=int, default=192, help="height and width in pixels (default %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--reps", type=int, default=3, help="timed calls of each kind per launch (default %(default)s)")
    p.add_argument("--runs", type=int, default=2, help="times the whole bench runs (default %(default)s)")
    p.add_argument("--quiet-load", type=float, default=1.0, help="1-minute load to wait for (default %(default)s)")
    p.add_argument("--poll", type=float, default=30, help=argparse.SUPPRESS)
    p.add_argument("--max-wait", type=float, default=600, help=argparse.SUPPRESS)
    p.add_argument("--attempts", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--max-others", type=float, default=0.1,
                   help="CPU (cores, on average) other processes may use during a launch (default %(default)s)")
    p.add_argument("--folder", type=Path, default=None, help="the pipeline folder (default: under outputs/bench/)")
    p.add_argument("--record", type=Path, default=None, help="write the JSON record here")
    p.add_argument("--worker", choices=tuple(LAYOUTS), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    folder = args.folder or ROOT / "outputs" / "bench" / f"wan22-h{args.heads}-l{args.layers}"
    if args.worker:
        worker(args.worker, str(folder), args)
        return 0
    if not (folder / "model_index.json").is_file():
        print(f"writing {folder} (float32) ...", file=sys.stderr, flush=True)
        make_folder(folder, args.heads, args.layers)

    runs = [one_run(folder, args, i + 1) for i in range(args.runs)]

    print(f"## bench_cache: first-block cache (threshold {args.threshold}) vs none; {args.steps} steps, CFG 5.0, "
          f"{args.frames}x{args.size}x{args.size}, {args.dtype}, output_type latent, {args.heads * 64} wide x "
          f"{args.layers} blocks x 2 experts, 1 torch thread per rank; {machine()}\n")
    rows = []
    for run in runs:
        for layout, r in run["layouts"].items():
            v = run["verdicts"].get(layout)
            rows.append([run["run"], r["layout"], r["quiet"]["loads"][-1], f"{r['median_none']:.2f}",
                         f"{r['median_cache']:.2f}", f"{r['speedup']:.3f}",
                         f"{v['ratio_to_1_process']:.3f}" if v else "", ("yes" if v["within_10pct"] else "NO") if v else "",
                         _count_str(r["counts"])])
    print(table(["run", "layout", "1-min load at start", "s no cache", "s cache", "speed-up",
                 "speed-up / 1 process", "within 10%", "computed/skipped forwards"], rows))
    counts_ok = all(v["counts_equal_to_1_process"] for run in runs for v in run["verdicts"].values()) and all(
        r["counts_same_every_call_and_rank"] for run in runs for r in run["layouts"].values())
    ok = all(v["within_10pct"] for run in runs for v in run["verdicts"].values())
    print(f"\ncounts identical in every call, rank and layout: {'yes' if counts_ok else 'NO'}")
    print(f"every 2-rank speed-up within 10% of the 1-process one: {'yes' if ok else 'NO'}")
    if args.record:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps({
            "bench": "bench_cache", "command": " ".join([".venv/bin/python", "bench/bench_cache.py", *sys.argv[1:]]),
            "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "library": _library(),
            "config": {"folder": folder.name, "heads": args.heads, "width": args.heads * 64, "layers": args.layers,
                       "experts": 2, "steps": args.steps, "frames": args.frames, "size": args.size,
                       "dtype": args.dtype, "guidance_scale": 5.0, "output_type": "latent", "threshold": args.threshold,
                       "reps": args.reps, "warmup_calls": 1, "torch_threads_per_rank": 1,
                       "single_process_loader": "hsdp.pipelines.load_pipeline(folder, None)",
                       "quiet_load": args.quiet_load},
            "runs": runs, "counts_identical": counts_ok, "all_within_10pct": ok,
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
