"""``hsdp serve`` under N concurrent clients against ``hsdp generate`` run in a loop.

    python bench/bench_serve.py [--model DIR] [--shard-size 2] [--clients 4] [--jobs 16] [--generate-runs 2]

Starts the server (``python -m hsdp serve --port 0``) on ``--shard-size`` ranks and measures:

- alone: ``--alone`` requests one after another; each request's latency (POST /v1/videos/sync to
  the last byte) and the job's own run time on rank 0 (``inference_seconds``: broadcast, pipeline
  call on every rank, mp4 written, outcome agreed). Their difference is the server's overhead per
  job (HTTP, form checks, queue, hand-over between threads, the file sent back);
- loaded: ``--jobs`` requests from ``--clients`` concurrent clients: throughput (jobs/min) and
  p50/p99 latency (p99 of a few dozen samples is close to their maximum);
- cancel: ``--cancels`` long jobs, each cancelled by DELETE once it has run 3 steps: seconds from
  the DELETE to the job ended ``cancelled`` (the bound is one step plus 1 s), and a step's seconds;
- ``hsdp generate`` with the same request, ``--generate-runs`` times in a loop (each run starts
  its ranks and loads the pipeline): jobs/min and p50/p99.

With ``--data-parallel-size D`` the loaded part runs twice more, on servers of the same ranks
and sharding: one request at a time on every rank (D=1) and D lanes (``--dp D``: up to D jobs at
once), alternating ``--dp-repeat`` times; it prints their jobs per minute and the ratio.

Without ``--model`` a tiny random Wan2.2 folder is written to a temporary folder first. Prints a
markdown table; ``--json FILE`` also writes the figures, ``--record FILE`` the figures with
every sample, the command, the machine, its load and the commit (bench/records/).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK_VARS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "PMIX_RANK",
             "MPI_LOCALNRANKS", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _start_server(model: Path, shard: int, workdir: Path,
                  extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "hsdp", "serve", "--model", str(model), "--port", "0", *extra]
    if shard > 1:
        cmd += ["--use-hsdp", "--hsdp-shard-size", str(shard)]
    proc = subprocess.Popen(cmd, cwd=workdir, env=_env(), stdout=subprocess.PIPE,
                            stderr=(workdir / "serve.err").open("w"), text=True)
    url = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on http://" in line:
            url = line.split("listening on ")[1].split()[0]
        if "ready:" in line:
            # keep draining stdout so the server never blocks on a full pipe
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, url
    raise SystemExit(f"the server exited {proc.wait()} before it was ready; see {workdir / 'serve.err'}")


def bench_server(args: argparse.Namespace, form: dict[str, str], workdir: Path) -> dict[str, object]:
    import httpx

    proc, url = _start_server(args.model, args.shard_size, workdir)
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            def one(seed: int) -> tuple[float, str]:
                started = time.perf_counter()
                r = client.post("/v1/videos/sync", data={**form, "seed": str(seed)})
                r.raise_for_status()
                return time.perf_counter() - started, r.headers["X-Video-Id"]

            one(0)  # warm-up: the first call records the prefetch order
            alone, run = [], []
            for i in range(args.alone):
                latency, job = one(100 + i)
                alone.append(latency)
                run.append(client.get(f"/v1/videos/{job}").json()["inference_seconds"])
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                loaded = [lat for lat, _ in pool.map(one, range(1000, 1000 + args.jobs))]
            wall = time.perf_counter() - started
            cancels = [_cancel_latency(client, form) for _ in range(args.cancels)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    overhead = [a - r for a, r in zip(alone, run, strict=True)]
    samples = {"alone_latency_s": alone, "alone_run_s": run, "overhead_s": overhead, "loaded_latency_s": loaded,
               "cancel_latency_s": [c for c, _ in cancels], "cancel_step_s": [st for _, st in cancels]}
    return {"samples": samples, "alone_latency_p50": _pct(alone, 0.5), "alone_run_p50": _pct(run, 0.5),
            "overhead_p50": _pct(overhead, 0.5), "overhead_max": max(overhead),
            "loaded_jobs_per_min": args.jobs / wall * 60, "loaded_p50": _pct(loaded, 0.5),
            "loaded_p99": _pct(loaded, 0.99), "loaded_wall": wall,
            "cancel_latency_p50": _pct([c for c, _ in cancels], 0.5), "cancel_latency_max": max(c for c, _ in cancels),
            "cancel_step_s_p50": _pct([st for _, st in cancels], 0.5)}


def _cancel_latency(client: object, form: dict[str, str]) -> tuple[float, float]:
    """A long job (400 steps), cancelled by DELETE once it has run 3 steps: seconds from the
    DELETE to the job no longer running, and the job's own seconds per step (the bound is one
    step plus 1 s)."""
    job = client.post("/v1/videos", data={**form, "num_inference_steps": "400"}).json()  # type: ignore[attr-defined]
    while client.get(f"/v1/videos/{job['id']}").json()["steps_done"] < 3:  # type: ignore[attr-defined]
        time.sleep(0.005)
    asked = time.perf_counter()
    client.delete(f"/v1/videos/{job['id']}")  # type: ignore[attr-defined]
    while (done := client.get(f"/v1/videos/{job['id']}").json())["status"] == "in_progress":  # type: ignore[attr-defined]
        time.sleep(0.002)
    took = time.perf_counter() - asked
    assert done["status"] == "cancelled", done
    return took, done["stage_durations"]["denoise"] / max(1, done["steps_done"])


def bench_lanes(args: argparse.Namespace, form: dict[str, str], workdir: Path) -> dict[str, object]:
    """Loaded jobs per minute on one request at a time (D=1) and on D lanes, same ranks and
    sharding, alternating."""
    import httpx

    def loaded(extra: tuple[str, ...]) -> float:
        proc, url = _start_server(args.model, args.shard_size, workdir, extra)
        try:
            with httpx.Client(base_url=url, timeout=600) as client:
                def one(seed: int) -> None:
                    client.post("/v1/videos/sync", data={**form, "seed": str(seed)}).raise_for_status()

                with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:  # warm-up: every lane records
                    list(pool.map(one, range(args.clients)))
                started = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                    list(pool.map(one, range(1000, 1000 + args.jobs)))
                return args.jobs / (time.perf_counter() - started) * 60
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
            log = (workdir / "serve.err").read_text()
            rounds[extra[-1] if extra else "1"] = [log.count(f"(a round of {k})") for k in range(1, d + 1)]

    d = args.data_parallel_size
    rounds: dict[str, list[int]] = {}
    runs: dict[str, list[float]] = {"d1": [], "dp": []}
    for _ in range(args.dp_repeat):
        runs["d1"].append(loaded(()))
        runs["dp"].append(loaded(("--data-parallel-size", str(d))))
    d1, dp = _pct(runs["d1"], 0.5), _pct(runs["dp"], 0.5)
    return {"d1_jobs_per_min": d1, "dp_jobs_per_min": dp, "dp_ratio": dp / d1, "d1_runs": runs["d1"],
            "dp_runs": runs["dp"], "dp_rounds_by_size": rounds.get(str(d))}


def bench_generate(args: argparse.Namespace, form: dict[str, str], workdir: Path) -> dict[str, object]:
    flags = ["--prompt", form["prompt"], "--width", form["width"], "--height", form["height"],
             "--num-frames", form["num_frames"], "--num-inference-steps", form["num_inference_steps"]]
    if args.shard_size > 1:
        flags += ["--use-hsdp", "--hsdp-shard-size", str(args.shard_size)]
    times = []
    started = time.perf_counter()
    for i in range(args.generate_runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "hsdp", "generate", "--model", str(args.model), *flags,
                        "--seed", str(i), "--output", str(workdir / f"g{i}.mp4")],
                       cwd=workdir, env=_env(), check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - started
    return {"generate_jobs_per_min": args.generate_runs / wall * 60, "generate_p50": _pct(times, 0.5),
            "generate_p99": _pct(times, 0.99)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a pipeline folder (default: a tiny random Wan2.2)")
    p.add_argument("--shard-size", type=int, default=2)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--jobs", type=int, default=16, help="requests under load")
    p.add_argument("--alone", type=int, default=4, help="requests one at a time")
    p.add_argument("--cancels", type=int, default=3, help="long jobs cancelled while they run")
    p.add_argument("--generate-runs", type=int, default=2)
    p.add_argument("--size", default="32x32")
    p.add_argument("--num-frames", default="5")
    p.add_argument("--steps", default="2")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--record", type=Path, default=None, help="write the figures, samples and context here")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="D",
                   help="also measure servers with D lanes against D=1 on the same ranks (default: not)")
    p.add_argument("--dp-repeat", type=int, default=2, help="servers of each kind, alternating (default %(default)s)")
    args = p.parse_args()
    width, height = args.size.split("x")
    form = {"prompt": "a cat in the snow", "width": width, "height": height, "num_frames": args.num_frames,
            "num_inference_steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        workdir = Path(tmp)
        args.model_was_default = args.model is None
        if args.model is None:
            from hsdp.testing.tiny_pipeline import make_tiny_pipeline

            args.model = make_tiny_pipeline(workdir / "tiny-wan22", "wan22")
        if args.data_parallel_size > 1:
            figures = bench_lanes(args, form, workdir)
            d = args.data_parallel_size
            print(f"| {args.shard_size} ranks, {args.size}, {args.num_frames} frames, {args.steps} steps, "
                  f"{args.clients} clients, {args.jobs} jobs | |")
            print("|---|---|")
            print(f"| one request at a time (D=1): jobs/min (median of {args.dp_repeat}) | "
                  f"{figures['d1_jobs_per_min']:.2f} ({', '.join(f'{v:.2f}' for v in figures['d1_runs'])}) |")
            print(f"| {d} lanes (--dp {d}): jobs/min | {figures['dp_jobs_per_min']:.2f} "
                  f"({', '.join(f'{v:.2f}' for v in figures['dp_runs'])}) |")
            print(f"| D={d} / D=1 | {figures['dp_ratio']:.2f} |")
            print(f"| rounds of 1..{d} jobs (the last D={d} server, warm-up included) | {figures['dp_rounds_by_size']} |")
            if args.json is not None:
                args.json.write_text(json.dumps(figures, indent=2))
            return 0
        load_before = os.getloadavg()
        figures = {**bench_server(args, form, workdir), **bench_generate(args, form, workdir)}
        load_after = os.getloadavg()
    samples = figures.pop("samples")
    rows = [
        ("server, one request at a time: latency p50", f"{figures['alone_latency_p50']:.3f} s"),
        ("  of which the job on the ranks (p50)", f"{figures['alone_run_p50']:.3f} s"),
        ("  server overhead per job (p50 / max)",
         f"{figures['overhead_p50'] * 1e3:.1f} / {figures['overhead_max'] * 1e3:.1f} ms"),
        ("cancel of a running job: DELETE to cancelled (p50 / max; bound: a step + 1 s)",
         (f"{figures['cancel_latency_p50'] * 1e3:.0f} / {figures['cancel_latency_max'] * 1e3:.0f} ms "
          f"(a step: {figures['cancel_step_s_p50'] * 1e3:.0f} ms)")),
        (f"server, {args.clients} concurrent clients, {args.jobs} jobs: throughput",
         f"{figures['loaded_jobs_per_min']:.1f} jobs/min"),
        ("  latency p50 / p99", f"{figures['loaded_p50']:.2f} / {figures['loaded_p99']:.2f} s"),
        (f"`hsdp generate` in a loop, {args.generate_runs} runs: throughput",
         f"{figures['generate_jobs_per_min']:.1f} jobs/min"),
        ("  latency p50 / p99", f"{figures['generate_p50']:.2f} / {figures['generate_p99']:.2f} s"),
    ]
    print(f"| {args.shard_size} ranks, {args.size}, {args.num_frames} frames, {args.steps} steps | |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    if args.record is not None:
        _write_record(args, figures, samples, {"before": load_before, "after": load_after})
    return 0


def _write_record(args: argparse.Namespace, figures: dict[str, object], samples: dict[str, object],
                  load: dict[str, object]) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from harness import machine

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text(json.dumps({
        "bench": "bench_serve", "command": " ".join([".venv/bin/python", "bench/bench_serve.py", *sys.argv[1:]]),
        "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_1_5_15": load,
        "library": {"commit": git("rev-parse", "--short", "HEAD"),
                    "uncommitted_under_python": git("status", "--short", "--", "python").splitlines()},
        "config": {"model": "a tiny random Wan2.2 folder" if args.model_was_default else str(args.model),
                   "ranks": args.shard_size, "size": args.size, "num_frames": args.num_frames, "steps": args.steps,
                   "dtype": "bfloat16 (the commands' default)", "alone": args.alone, "clients": args.clients,
                   "jobs": args.jobs, "cancels": args.cancels, "cancel_job_steps": 400,
                   "generate_runs": args.generate_runs},
        "figures": figures, "samples": samples,
    }, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
