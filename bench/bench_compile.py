"""torch.compile's speed-up on a model hsdp has sharded (2 ranks, HSDP 1x2) next to its speed-up
on the same model unsharded (1 process), in one run.

    .venv/bin/python bench/bench_compile.py [--layers 8] [--heads 8] [--tokens 864] [--reps 5] [--record PATH]

The model is a stock diffusers ``WanTransformer3DModel`` with random weights (``--heads`` x 64
wide, FFN 4x, ``--layers`` blocks) in bfloat16, as a user loads it
(``load_pipeline(..., torch_dtype=torch.bfloat16)``, the loader's default too), fed one fixed
bfloat16 input: a latent of ``--tokens`` patches (6 frames x H x W after Wan's (1, 2, 2)
patching) and 64 text tokens. A "step" is one transformer forward, what a denoising step calls
(twice with guidance). Nothing is set that a user would not set: the sharded model takes
``HSDPInferenceConfig``'s defaults (``param_dtype`` bfloat16: the model's own dtype, so both
launches time the same bfloat16 arithmetic).

Two launches (``harness.launch``), each timing three ways of running the same weights,
interleaved rep by rep (eager, whole, regional / whole, regional, eager / ...), the figure the
median:

- **eager**: the model as it is (1 process: unsharded; 2 ranks: sharded by
  ``hsdp.apply_hsdp_to_model`` with the defaults, every block a unit, as load_pipeline shards it);
- **whole**: ``torch.compile(model)``;
- **regional**: a second copy of the model with ``model.compile_repeated_blocks()``
  (diffusers' regional compile, what ``--compile regional`` does).

Each compiled way runs once first (the warm-up, timed and reported: that is what the first
request waits for), then ``--reps`` times. speed-up = t(eager) / t(compiled) per launch; the
verdict: hsdp's speed-up over the unsharded model's, goal >= 0.9, for each compiled way. Each
rank runs one torch thread (the harness's environment), the 1-process launch too; the driver
waits for a quiet machine before each launch (``harness.wait_quiet``) and records the loads.
Outputs are checked against eager in every launch by relative L2 (||compiled - eager|| /
||eager|| <= 3e-2), not max abs: in bfloat16 Inductor computes each fused chain of elementwise
ops in float32 and rounds once, where eager rounds every op's output to bfloat16 (a relative
2^-8 each time), so the two differ by a few roundings per block, spread over the whole output
(tests/test_compile.py checks exactness in float32, within 1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, interleaved, launch, machine, table, wait_quiet  # noqa: E402

WAYS = ("eager", "whole", "regional")
DTYPE_NAME = "bfloat16"  # load_pipeline's default torch_dtype and HSDPInferenceConfig's param_dtype
TOLERANCE = 3e-2  # relative L2 against eager in bfloat16 (the module's docstring says why)


def dtype() -> Any:
    """torch's bfloat16 (torch is imported in the workers only)."""
    import torch

    return getattr(torch, DTYPE_NAME)


def make(args: argparse.Namespace) -> Any:
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=args.heads, attention_head_dim=64, in_channels=16, out_channels=16,
        text_dim=256, freq_dim=256, ffn_dim=args.heads * 64 * 4, num_layers=args.layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    ).to(dtype()).eval()


def inputs(args: argparse.Namespace) -> tuple[Any, ...]:
    import torch

    side = round((args.tokens / 6) ** 0.5)  # patches per side of each of the 6 latent frames
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 6, 2 * side, 2 * side, generator=g)
    # the model's dtype, as the pipeline casts its latents and text embeddings
    return x.to(dtype()), torch.tensor([500]), torch.randn(1, 64, 256, generator=g).to(dtype())


def worker(args: argparse.Namespace) -> None:
    import torch

    import hsdp
    from hsdp.world.distributed import init_process_group

    world = init_process_group()
    x, t, ctx = inputs(args)

    def build() -> Any:
        model = make(args)
        if world.size > 1:
            from hsdp.pipelines.conditions import shard_conditions_for

            # the registry's units for Wan (a block each), as load_pipeline shards it
            model._hsdp_shard_conditions = list(shard_conditions_for(type(model)) or ())
            # the defaults (param_dtype bfloat16: the model's own dtype, as a user's bfloat16 load)
            hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, hsdp_shard_size=world.size))
        return model

    eager = build()
    regional = build()
    regional.compile_repeated_blocks()
    models = {"eager": eager, "whole": torch.compile(eager), "regional": regional}

    def step(way: str) -> torch.Tensor:
        with torch.inference_mode():
            return models[way](x, t, ctx, return_dict=False)[0]

    record: dict[str, Any] = {"rank": world.rank, "ranks": world.size, "torch_threads": torch.get_num_threads(),
                              "tokens": int(x.shape[2] * x.shape[3] * x.shape[4] // 4), "warmup_s": {}}
    expect = step("eager")  # the first eager forward records the prefetch order
    for way in ("whole", "regional"):
        world.barrier()
        t0 = time.perf_counter()
        got = step(way)
        record["warmup_s"][way] = round(time.perf_counter() - t0, 2)
        assert got.dtype == expect.dtype == dtype(), (got.dtype, expect.dtype)
        rel = ((got.float() - expect.float()).norm() / expect.float().norm()).item()
        assert rel <= TOLERANCE, f"{way}: relative L2 against eager {rel:.3g}, over {TOLERANCE:g}"
        record[f"rel_l2_{way}"] = rel
    fns = [lambda w=w: step(w) for w in WAYS]
    torch._dynamo.config.error_on_recompile = True  # steady state: a recompile would be timed
    record["step_s"] = dict(zip(WAYS, interleaved(fns, args.reps, sync=world.barrier)))
    Path(args.out, f"{world.rank}.json").write_text(json.dumps(record))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=864)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quiet-load", type=float, default=1.0)
    p.add_argument("--record", type=Path, default=ROOT / "bench" / "records" / "bench_compile.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    flags = ["--layers", str(args.layers), "--heads", str(args.heads), "--tokens", str(args.tokens),
             "--reps", str(args.reps)]
    results: dict[str, Any] = {}
    for label, n in (("unsharded", 1), ("hsdp", 2)):
        quiet = wait_quiet(args.quiet_load)
        with tempfile.TemporaryDirectory() as out:
            t0 = time.time()
            launch(n, "bench/bench_compile.py", "--worker", "--out", out, *flags, timeout=3600)
            ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(n)]
        results[label] = {"launch": quiet, "seconds": round(time.time() - t0), "ranks": ranks}
    rows, verdict = [], {}
    speedups: dict[str, dict[str, float]] = {}
    for label, res in results.items():
        steps = res["ranks"][0]["step_s"]
        speedups[label] = {w: steps["eager"] / steps[w] for w in ("whole", "regional")}
        rows.append([label, f"{steps['eager']:.3f}", f"{steps['whole']:.3f}", f"{steps['regional']:.3f}",
                     f"{speedups[label]['whole']:.3f}", f"{speedups[label]['regional']:.3f}",
                     f"{res['ranks'][0]['warmup_s']['whole']:.1f} / {res['ranks'][0]['warmup_s']['regional']:.1f}"])
    for w in ("whole", "regional"):
        ratio = speedups["hsdp"][w] / speedups["unsharded"][w]
        verdict[w] = {"ratio_of_speedups": round(ratio, 3), "goal": 0.9, "met": ratio >= 0.9}
    print(table(["layout", "eager s/step", "whole s/step", "regional s/step", "whole speed-up", "regional speed-up",
                 "warm-up s (whole / regional)"], rows))
    for w, v in verdict.items():
        print(f"{w}: hsdp's speed-up / the unsharded model's = {v['ratio_of_speedups']:.3f} "
              f"(goal >= 0.9: {'met' if v['met'] else 'missed'})")
    record = {"bench": "bench_compile", "machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M"),
              "args": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "record")},
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "results": results,
              "speedups": speedups, "verdict": verdict}
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"record: {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
