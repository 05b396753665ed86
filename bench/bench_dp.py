"""Data parallel under HSDP: videos per minute with D lanes against one, the same ranks and the
same sharding (S = the ranks), in one run.

    .venv/bin/python bench/bench_dp.py [--ranks 2] [--prompts 4] [--layers 8] [--heads 8]

The pipeline folder is bench_pipeline.py's Wan2.2-style one (two transformer experts of
``--heads`` x 64 width and ``--layers`` blocks, tiny_pipeline's text encoder and VAE), written
once under outputs/bench/. Each job is N ranks under mpiexec that load it with
``hsdp.pipelines.load_pipeline`` (both transformers and the text encoder sharded over the N
ranks), then call ``hsdp.pipelines.generate`` once with the ``--prompts`` prompts and one
generator each, as a user would (a first call, on one prompt, warms up). D=1: one request on
every rank (the stock batched call: every rank computes the whole batch). D=N: N lanes, each
its share of the batch; the lanes gather in lockstep. Jobs alternate D=1 and D=N, ``--repeat``
times; the figure is the median seconds per call on rank 0, and each rank's peak resident set
(VmHWM) at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import make_folder  # noqa: E402
from harness import ROOT, launch, machine, table, vm_kib  # noqa: E402

MIB = 1 << 20
PROMPTS = ["a red fish swimming in the river", "a cat walking on a roof", "two boats on a lake at dawn",
           "a city street in the rain", "a horse running on a beach", "snow falling on a forest",
           "a kite over a field", "a train crossing a bridge"]


def worker(folder: str, lanes: int, ranks: int, prompts: int, steps: int, frames: int, size: int, dtype_name: str,
           out: str) -> None:
    import torch

    import hsdp.pipelines as hp
    from hsdp.engine.config import DiffusionParallelConfig
    from hsdp.world.distributed import init_process_group

    world = init_process_group()
    if lanes > 1:
        config = DiffusionParallelConfig(use_hsdp=True, data_parallel_size=lanes)
    else:
        config = DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=ranks)
    pipe = hp.load_pipeline(folder, config, torch_dtype=getattr(torch, dtype_name), progress=False)
    pipe.set_progress_bar_config(disable=True)
    call = dict(negative_prompt="blurry", height=size, width=size, num_frames=frames, num_inference_steps=steps,
                output_type="np")
    batch = [PROMPTS[i % len(PROMPTS)] for i in range(prompts)]
    hp.generate(pipe, prompt=batch[:lanes], generator=[torch.Generator().manual_seed(i) for i in range(lanes)],
                **call)  # warm-up: every lane records its order
    world.barrier()
    t0 = time.perf_counter()
    out_ = hp.generate(pipe, prompt=batch, generator=[torch.Generator().manual_seed(i) for i in range(prompts)],
                       **call)
    world.barrier()
    seconds = time.perf_counter() - t0
    if world.rank == 0:
        assert out_.frames.shape[0] == prompts, out_.frames.shape
    Path(out, f"{world.rank}.json").write_text(json.dumps({"rank": world.rank, "seconds": seconds,
                                                          "peak": vm_kib() * 1024}))


def run(lanes: int, folder: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="hsdp-bench-dp-") as out:
        launch(args.ranks, __file__, "--worker", str(lanes), "--folder", str(folder), "--ranks", str(args.ranks),
               "--prompts", str(args.prompts), "--steps", str(args.steps), "--frames", str(args.frames),
               "--size", str(args.size), "--dtype", args.dtype, "--out", out, timeout=3600)
        return sorted((json.loads(f.read_text()) for f in Path(out).glob("*.json")), key=lambda r: r["rank"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks of every job; D = this (default %(default)s)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per call (default %(default)s)")
    p.add_argument("--heads", type=int, default=8, help="attention heads of 64 (default %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="blocks per transformer (default %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps (default %(default)s)")
    p.add_argument("--frames", type=int, default=17, help="video frames (default %(default)s)")
    p.add_argument("--size", type=int, default=160, help="height and width in pixels (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeat", type=int, default=3, help="jobs of each kind, alternating (default %(default)s)")
    p.add_argument("--folder", type=Path, default=None, help="the pipeline folder (default: under outputs/bench/)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    folder = args.folder or ROOT / "outputs" / "bench" / f"wan22-h{args.heads}-l{args.layers}"
    if args.worker:
        worker(str(folder), args.worker, args.ranks, args.prompts, args.steps, args.frames, args.size, args.dtype,
               args.out)
        return 0
    if not (folder / "model_index.json").is_file():
        print(f"writing {folder} (float32) ...", file=sys.stderr, flush=True)
        make_folder(folder, args.heads, args.layers)
    runs: dict[int, list[list[dict[str, Any]]]] = {1: [], args.ranks: []}
    for _ in range(args.repeat):
        for lanes in runs:
            runs[lanes].append(run(lanes, folder, args))
    secs = {d: statistics.median(r[0]["seconds"] for r in reps) for d, reps in runs.items()}
    peaks = {d: [max(rep[k]["peak"] for rep in reps) for k in range(args.ranks)] for d, reps in runs.items()}
    per_min = {d: 60 * args.prompts / s for d, s in secs.items()}
    d = args.ranks
    rows = [[f"D={lanes}", f"{secs[lanes]:.2f}", f"{per_min[lanes]:.2f}",
             " / ".join(f"{b / MIB:.0f}" for b in peaks[lanes])] for lanes in runs]
    print(f"## bench_dp: {args.ranks} ranks, S={args.ranks}, {args.prompts} prompts, {args.steps} steps, "
          f"{args.frames}x{args.size}x{args.size}, {args.dtype}, {args.heads * 64} wide x {args.layers} blocks x 2 "
          f"experts; {machine()}")
    print(table(["job", "s per call (median)", "videos / min", "peak RSS per rank (MiB)"], rows))
    each = {lanes: [round(r[0]["seconds"], 2) for r in reps] for lanes, reps in runs.items()}
    print(f"videos per minute, D={d} / D=1: {per_min[d] / per_min[1]:.2f} (runs: D=1 {each[1]}, D={d} {each[d]})")
    worst = max(a / b for a, b in zip(peaks[d], peaks[1], strict=True))
    print(f"peak RSS per rank, D={d} / D=1: {worst:.3f} (the worst rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
