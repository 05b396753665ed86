"""A whole diffusers pipeline: hsdp.pipelines.load_pipeline on N ranks vs the stock pipeline.

    .venv/bin/python bench/bench_pipeline.py [--ranks 2] [--layers 12] [--heads 12] [--steps 4]

Writes (once, cached under outputs/bench/) a Wan2.2-style folder: tiny_pipeline's tokenizer,
text encoder and VAE, and two ``WanTransformer3DModel`` experts big enough to matter here
(``--heads`` x 64 wide, ``--layers`` blocks; the default is 118.5 M parameters, 452 MiB
in float32, per transformer), saved in float32 as ``save_pretrained`` does. Then, in one run:

- **stock**: N ranks, each ``DiffusionPipeline.from_pretrained(folder, torch_dtype=...)``
  and the same call: a replicated job, whose ranks compete for the cores as the sharded
  job's do;
- **sharded**: N ranks under mpiexec, ``hsdp.pipelines.load_pipeline`` with
  ``--use-hsdp --hsdp-shard-size N``: both transformers and the text encoder sharded and
  streamed rank-locally, the VAE replicated.

The two kinds of job run interleaved, ``--repeat`` times each (times: the median per rank;
memory: the highest). Each process reports its load time, its peak resident set (VmHWM)
after loading and after the denoising loop, and its baseline (VmHWM after the imports, before any weight). Both run
the same call (``output_type="latent"``: the loop, not the VAE decode) for ``--steps``
steps; seconds per step is the mean of steps 2.. (the first also encodes the prompt and
records the prefetch order). The load peak of each rank is checked against
1.1 x (its shards + one block + the replicated parts + the baseline), one block being the
largest unit as stored in the checkpoint (float32).

Prints a markdown table (MiB = 2^20 bytes) and the ratios sharded / stock.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import MPI_ENV, ROOT, machine, table, vm_kib  # noqa: E402

MIB = 1 << 20
PROMPT = "a red fish swimming in the river"


# ----------------------------------------------------------------------------- the folder


def make_folder(folder: Path, heads: int, layers: int) -> None:
    """tiny_pipeline's Wan2.2 parts with two big transformers; float32 on disk."""
    import torch
    from diffusers import WanTransformer3DModel

    from hsdp.testing.tiny_pipeline import build_tiny_pipeline

    pipe = build_tiny_pipeline("wan22", seed=0)
    text_dim = pipe.text_encoder.config.d_model
    for i, name in enumerate(("transformer", "transformer_2")):
        torch.manual_seed(100 + i)
        big = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=64, in_channels=16, out_channels=16,
            text_dim=text_dim, freq_dim=256, ffn_dim=4 * heads * 64, num_layers=layers, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
        ).eval()
        pipe.register_modules(**{name: big})
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, folder)


# ----------------------------------------------------------------------------- one process


def _largest_unit_file_bytes(model: Any) -> int:
    """The largest unit's bytes as stored in the checkpoint (float32 there)."""
    ctx = model._hsdp_context
    return max(sum(nb // dt.itemsize * 4 for nb, dt in zip(st.unit.nbytes, st.storage_dtypes)) for st in ctx.units)


def worker(mode: str, folder: str, dtype_name: str, ranks: int, steps: int, frames: int, size: int, out: str) -> None:
    import torch
    # The classes the folder names, imported here: the code belongs to the baseline, not to the load
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel  # noqa: F401
    from transformers import PreTrainedTokenizerFast, UMT5EncoderModel  # noqa: F401

    from hsdp.world.distributed import init_process_group

    world = init_process_group()
    dtype = getattr(torch, dtype_name)
    world.barrier()
    baseline = vm_kib() * 1024
    t0 = time.perf_counter()
    if mode == "stock":
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=dtype)
        held, replicated, block = 0, 0, 0
    else:
        from hsdp.engine.config import DiffusionParallelConfig
        from hsdp.pipelines import load_pipeline, pipeline_state

        config = DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=ranks)
        pipe = load_pipeline(folder, config, torch_dtype=dtype, progress=False)
        state = pipeline_state(pipe)
        held = sum(c.local_bytes for c in state.components.values() if c.sharded)
        replicated = sum(c.bytes for c in state.components.values() if not c.sharded)
        block = max(_largest_unit_file_bytes(getattr(pipe, n)) for n in state.sharded)
    world.barrier()
    load_seconds = time.perf_counter() - t0
    load_peak = vm_kib() * 1024
    pipe.set_progress_bar_config(disable=True)
    ends: list[float] = []

    def clock(p: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        ends.append(time.perf_counter())
        return kw

    pipe(prompt=PROMPT, negative_prompt="blurry", height=size, width=size, num_frames=frames,
         num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(0), output_type="latent",
         callback_on_step_end=clock)
    later = [b - a for a, b in zip(ends, ends[1:])]
    Path(out, f"{mode}{world.rank}.json").write_text(json.dumps({
        "rank": world.rank, "baseline": baseline, "load_seconds": load_seconds, "load_peak": load_peak,
        "peak": vm_kib() * 1024, "held": held, "replicated": replicated, "block": block,
        "seconds_per_step": sum(later) / len(later),
    }))


# ----------------------------------------------------------------------------- the driver


def run(mode: str, n: int, folder: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    exe = shutil.which("mpiexec")
    if exe is None:
        raise SystemExit("mpiexec is not installed (apt-get install openmpi-bin)")
    with tempfile.TemporaryDirectory(prefix="hsdp-bench-") as out:
        cmd = [exe, "-n", str(n), sys.executable, __file__, "--worker", mode, "--folder", str(folder),
               "--dtype", args.dtype, "--ranks", str(args.ranks), "--steps", str(args.steps),
               "--frames", str(args.frames), "--size", str(args.size), "--out", out]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **MPI_ENV}, capture_output=True, text=True,
                              timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return sorted((json.loads(f.read_text()) for f in Path(out).glob(f"{mode}*.json")), key=lambda r: r["rank"])


def _per_rank(reps: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each rank's record over the repeats: median times, highest memory."""
    out = []
    for records in zip(*reps):
        merged = dict(records[0])
        for key in ("load_seconds", "seconds_per_step"):
            merged[key] = statistics.median(r[key] for r in records)
        for key in ("load_peak", "peak", "baseline"):
            merged[key] = max(r[key] for r in records)
        out.append(merged)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks of the sharded job (default %(default)s)")
    p.add_argument("--heads", type=int, default=12, help="attention heads of 64 (default %(default)s)")
    p.add_argument("--layers", type=int, default=12, help="blocks per transformer (default %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps (default %(default)s)")
    p.add_argument("--frames", type=int, default=9, help="video frames (default %(default)s)")
    p.add_argument("--size", type=int, default=64, help="height and width in pixels (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeat", type=int, default=3, help="jobs of each kind, interleaved (default %(default)s)")
    p.add_argument("--folder", type=Path, default=None, help="the pipeline folder (default: under outputs/bench/)")
    p.add_argument("--worker", choices=("stock", "sharded"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, str(args.folder), args.dtype, args.ranks, args.steps, args.frames, args.size, args.out)
        return 0

    folder = args.folder or ROOT / "outputs" / "bench" / f"wan22-h{args.heads}-l{args.layers}"
    if not (folder / "model_index.json").is_file():
        print(f"writing {folder} (float32) ...", file=sys.stderr, flush=True)
        make_folder(folder, args.heads, args.layers)
    on_disk = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    # Interleaved, job after job, so the drift of a shared machine hits both alike; per rank,
    # the median time over the repeats and the highest memory
    runs: dict[str, list[list[dict[str, Any]]]] = {"stock": [], "sharded": []}
    for _ in range(args.repeat):
        for mode in runs:
            runs[mode].append(run(mode, args.ranks, folder, args))
    stocks, sharded = (_per_rank(runs[mode]) for mode in ("stock", "sharded"))

    rows = [[f"stock, rank {r['rank']} of {args.ranks}", f"{r['load_seconds']:.2f}", f"{r['load_peak'] / MIB:.0f}",
             f"{r['peak'] / MIB:.0f}", f"{r['baseline'] / MIB:.0f}", "", "", f"{r['seconds_per_step']:.3f}"]
            for r in stocks]
    # the stock job's worst rank, as the sharded job's: what a job of N ranks waits for and needs
    stock = {k: max(r[k] for r in stocks) for k in ("load_seconds", "load_peak", "peak", "seconds_per_step")}
    stock["baseline"] = max(r["baseline"] for r in stocks)
    for r in sharded:
        bound = 1.1 * (r["held"] + r["block"] + r["replicated"] + r["baseline"])
        rows.append([f"sharded, rank {r['rank']} of {args.ranks}", f"{r['load_seconds']:.2f}",
                     f"{r['load_peak'] / MIB:.0f}", f"{r['peak'] / MIB:.0f}", f"{r['baseline'] / MIB:.0f}",
                     f"{r['held'] / MIB:.0f} + {r['block'] / MIB:.0f} + {r['replicated'] / MIB:.2f}",
                     f"{r['load_peak'] / bound:.2f}", f"{r['seconds_per_step']:.3f}"])
    print(f"machine: {machine()}; folder {folder.name}: {on_disk / MIB:.0f} MiB of safetensors (float32), "
          f"loaded as {args.dtype}; {args.frames} frames of {args.size}x{args.size}, {args.steps} steps; "
          f"times: median of {args.repeat} interleaved jobs of each kind\n")
    print(table(["process", "load s", "load peak MiB", "run peak MiB", "baseline MiB",
                 "shards + block + replicated MiB", "load peak / 1.1 x bound", "s/step"], rows))
    worst = max(sharded, key=lambda r: r["load_peak"])
    slowest = max(r["load_seconds"] for r in sharded)
    print(f"\nsharded / stock: load time {slowest / stock['load_seconds']:.2f}, "
          f"load peak (worst rank) {worst['load_peak'] / stock['load_peak']:.2f}, "
          f"load peak above baseline {(worst['load_peak'] - worst['baseline']) / (stock['load_peak'] - stock['baseline']):.2f}, "
          f"run peak {max(r['peak'] for r in sharded) / stock['peak']:.2f}, "
          f"s/step {max(r['seconds_per_step'] for r in sharded) / stock['seconds_per_step']:.2f}")
    ok = all(r["load_peak"] <= 1.1 * (r["held"] + r["block"] + r["replicated"] + r["baseline"]) for r in sharded)
    print("load peak within 1.1 x (shards + one block + replicated + baseline) on every rank: "
          + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
