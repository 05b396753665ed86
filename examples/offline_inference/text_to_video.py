"""Text-to-video with the reference diffusion transformer, its weights sharded by HSDP.

A small offline pipeline: build the transformer from a size preset, shard it across the ranks
(``--use-hsdp``), then run a flow-matching Euler sampler for ``--num-inference-steps`` steps
from seeded noise and a seeded stand-in for the text embedding. Rank 0 saves the final
latents, prints one table (memory, speed, and with ``--verify`` the largest difference from
an unsharded run of the same loop) and writes the same data as JSON next to the latents.

    python -m hsdp.launch -n 4 -- examples/offline_inference/text_to_video.py \\
        --use-hsdp --hsdp-shard-size 4 --verify
    # combined: Ulysses sequence parallel x CFG parallel, HSDP over the same 4 ranks
    python -m hsdp.launch -n 4 -- examples/offline_inference/text_to_video.py \\
        --ulysses-degree 2 --cfg-parallel-size 2 --use-hsdp --verify
    # USP: Ulysses 2 x ring attention 2, HSDP over the same 4 ranks
    python -m hsdp.launch -n 4 -- examples/offline_inference/text_to_video.py \\
        --ulysses-degree 2 --ring-degree 2 --use-hsdp --verify

Classifier-free guidance (``--guidance-scale``, default 5.0 as in Wan; 1 turns it off) runs a
conditional and an unconditional branch per step; ``--cfg-parallel-size 2`` puts them on the two
halves of the ranks. ``--ulysses-degree N`` splits the tokens over N ranks (``--usp N``, the
guide's spelling, is the same flag); ``--ring-degree N`` runs ring attention over N ranks, alone
or inside Ulysses (USP). --verify compares with one unsharded rank running both branches: exact without sequence
parallelism, within 1e-5 relative with it (a matrix product over fewer rows rounds differently).

Exit status: 0 on success, 1 when --verify finds a difference, 2 for a configuration error
or a parallel degree the runtime cannot execute yet.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import hsdp
from hsdp import models, parallel as par
from hsdp.config import DiffusionParallelConfig, add_parallel_args
from hsdp.distributed import init_process_group

# A module next to this script: `python SCRIPT` and hsdp.launch both put its folder on sys.path.
from inference_report import (
    EXIT_MISMATCH,
    Progress,
    add_guidance_args,
    add_run_args,
    broadcast_int,
    build_report,
    check_guidance_args,
    check_run_args,
    compare,
    config_error,
    format_table,
    gather_ints,
    peak_rss_bytes,
    reset_peak_rss,
    report_rows,
    write_json,
)

TEXT_LEN = 16  # tokens of the stand-in text embedding


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Text-to-video on the reference DiT, weights sharded with HSDP.")
    add_run_args(p, models.preset_names(), "outputs/text_to_video.npy", "safetensors checkpoint")
    add_guidance_args(p)
    add_parallel_args(p)
    args = p.parse_args(argv)
    check_guidance_args(p, args)
    check_run_args(p, args)
    patch = models.DiTConfig.preset(args.preset).patch_size
    for name, size, n in zip(("frames", "height", "width"), (args.frames, args.height, args.width), patch):
        if size % n:
            p.error(f"--{name} {size} must be a multiple of the patch size {n} ({args.preset} preset)")
    return args


# ------------------------------------------------------------------------------------ model


def _round_weights(model: Any, dtype: str) -> None:
    """Round every floating weight to ``dtype``: the values a ``dtype`` shard holds."""
    if dtype == "float32":
        return
    for p in model.parameters():
        if p.is_floating_point() and p.ndim > 0:
            p.data = hsdp._C.round_to(np.ascontiguousarray(p.data, dtype=np.float32), dtype)


def checkpoint_path(args: argparse.Namespace) -> Path:
    return args.checkpoint_dir / f"dit-{args.preset}-seed{args.seed}.safetensors"


def ensure_checkpoint(args: argparse.Namespace, world: Any, progress: Progress) -> Path:
    """The model's weights as a safetensors file, written by rank 0 on first use (no
    downloads: the weights come from --seed). Written to a temporary name and renamed, so an
    interrupted write never leaves a file that looks complete."""
    path = checkpoint_path(args)
    if world.rank == 0 and not path.exists():
        progress.note(f"writing the checkpoint {path} (first use)")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        hsdp.save_checkpoint(models.make_model(args.preset, seed=args.seed), tmp)
        os.replace(tmp, path)
    world.barrier()
    return path


def _meta_model(args: argparse.Namespace) -> Any:
    with hsdp.nn.meta_init():  # shapes and dtypes only: no weight memory
        return models.make_model(args.preset)


def unsharded_model(args: argparse.Namespace, path: Path) -> Any:
    """The whole model on this rank, loaded from the checkpoint, with the values a
    ``--param-dtype`` shard would hold (the NumPy runtime computes bfloat16 widened to
    float32, so the arrays stay float32)."""
    model = hsdp.checkpoint.load_model_whole(_meta_model(args), path, progress=False)
    _round_weights(model, args.param_dtype)
    return model


def build_model(args: argparse.Namespace, hsdp_cfg: Any | None, path: Path) -> Any:
    """The transformer this rank runs: sharded when ``hsdp_cfg`` is given, else whole. Sharded,
    each rank reads only its own shard of every block from the file: no rank ever holds the
    whole model."""
    if hsdp_cfg is None:
        return unsharded_model(args, path)
    return hsdp.load_model_sharded(_meta_model(args), path, hsdp_cfg)


# ------------------------------------------------------------------------------------ sampling


def initial_noise(args: argparse.Namespace, config: models.DiTConfig) -> np.ndarray:
    """x_T ~ N(0, 1), from --seed alone, so every rank starts from the same latents."""
    rng = np.random.default_rng([args.seed, 1])
    shape = (args.batch, config.in_channels, args.frames, args.height, args.width)
    return rng.standard_normal(shape).astype(np.float32)


def text_context(args: argparse.Namespace, config: models.DiTConfig, negative: bool = False) -> np.ndarray:
    """A stand-in for the text encoder's output: a seeded embedding (no tokenizer, no
    download). `negative`: the negative prompt's, for the unconditional branch."""
    rng = np.random.default_rng([args.seed, 3 if negative else 2])
    return rng.standard_normal((args.batch, TEXT_LEN, config.text_dim)).astype(np.float32)


def denoise(
    model: Any, x: np.ndarray, contexts: tuple[np.ndarray, np.ndarray], steps: int, progress: Progress,
    guidance_scale: float = 1.0, groups: par.ParallelGroups = par.SINGLE,
) -> tuple[np.ndarray, list[float]]:
    """Flow-matching Euler: t from 1 (noise) to 0 (data), x <- x + (t_next - t) * v(x, t), with
    v guided from the (conditional, negative) contexts unless the scale is 1."""
    timesteps = np.linspace(1.0, 0.0, steps + 1, dtype=np.float32)
    seconds = []
    for i in range(steps):
        start = time.perf_counter()
        t = np.full((x.shape[0],), timesteps[i] * 1000.0, dtype=np.float32)
        if guidance_scale == 1.0:
            v = model(x, t, contexts[0])
        else:
            v = par.cfg_combine(groups, lambda branch: model(x, t, contexts[branch]), guidance_scale)
        x = (x + (timesteps[i + 1] - timesteps[i]) * v).astype(np.float32)
        seconds.append(time.perf_counter() - start)
        progress.step(i + 1, seconds[-1])
    return x, seconds


# ------------------------------------------------------------------------------------ report


def _param_bytes(model: Any, param_dtype: str) -> dict[str, int]:
    """Count and unsharded size of the weights, in the storage dtype and in float32."""
    itemsize = hsdp.dtypes.as_dtype(param_dtype).itemsize
    count = stored = f32 = 0
    for p in model.parameters():
        n = p.numel()
        count += n
        f32 += n * 4
        stored += n * (itemsize if p.is_floating_point() and p.ndim > 0 else p.dtype.itemsize)
    return {"count": count, "unsharded_bytes": stored, "unsharded_bytes_float32": f32}


def _held_bytes(model: Any, sharded: bool) -> int:
    """Weight bytes this rank keeps between forwards: its shards plus what is kept whole.

    Unsharded buffers live only while a block computes and are left out. Unsharded, the
    whole model is held, in float32 arrays.
    """
    if not sharded:
        return sum(p.data.nbytes for p in model.parameters())
    stats = hsdp.memory_stats()
    return stats["sharded_bytes"] + stats["whole_bytes"]


def _verify(args: argparse.Namespace, x_t: np.ndarray, contexts: tuple[np.ndarray, np.ndarray],
            result: np.ndarray, sequence_parallel: bool) -> dict[str, Any]:
    """The same loop on one unsharded rank (both CFG branches there, no sequence split); the
    largest difference. Exact is required unless the tokens were split (inference_report.compare)."""
    progress = Progress(True, "verify step", args.num_inference_steps)
    progress.note("verify: running the same loop unsharded on rank 0")
    reference, _ = denoise(unsharded_model(args, checkpoint_path(args)), x_t, contexts, args.num_inference_steps,
                           progress, args.guidance_scale)
    return compare(result, reference, sequence_parallel)


# ------------------------------------------------------------------------------------ main


def _configure(args: argparse.Namespace, world: Any) -> tuple[DiffusionParallelConfig, Any | None]:
    """The parallel config, checked against the launched world; ValueError says what to fix."""
    parallel = DiffusionParallelConfig.from_cli_args(args)
    parallel.check_world(world.size)
    hsdp_cfg = parallel.to_hsdp_config(param_dtype=args.param_dtype) if parallel.use_hsdp else None
    return parallel, hsdp_cfg


def _config_error(is_rank0: bool, message: str) -> int:
    return config_error("text_to_video", is_rank0, message)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    world = init_process_group()
    is_rank0 = world.rank == 0
    # hsdp's own log lines (mesh setup, units made) on rank 0 only: every rank says the same.
    logging.basicConfig(level=logging.INFO if is_rank0 else logging.WARNING, format="%(name)s: %(message)s")

    try:
        parallel, hsdp_cfg = _configure(args, world)
    except ValueError as exc:
        return _config_error(is_rank0, str(exc))

    phase = Progress(is_rank0, "build")
    path = ensure_checkpoint(args, world, phase)
    # Writing the checkpoint on first use materialises the whole model once on rank 0; the
    # report's peak memory is about loading and running, so start its count here.
    reset_peak_rss()
    phase.note(f"loading the '{args.preset}' model (seed {args.seed}) on {world.size} rank(s): {parallel}")
    model = build_model(args, hsdp_cfg, path)
    phase.done()
    held = _held_bytes(model, hsdp_cfg is not None)

    try:
        # The sequence-parallel and CFG groups, over the same ranks as the HSDP mesh.
        groups = par.init_parallel_groups(parallel, world)
        par.apply_sequence_parallel(model, groups.sp)
        config = model.config
        tokens = (args.frames // config.patch_size[0]) * (args.height // config.patch_size[1]) * (
            args.width // config.patch_size[2])
        local_tokens = groups.sp.local_tokens(tokens) if groups.sp is not None else tokens
    except NotImplementedError as exc:
        return _config_error(is_rank0, f"NotImplementedError: {exc}")
    except ValueError as exc:
        return _config_error(is_rank0, str(exc))

    x_t = initial_noise(args, config)
    contexts = (text_context(args, config), text_context(args, config, negative=True))
    loop = Progress(is_rank0, "step", args.num_inference_steps)
    if args.resident and hsdp_cfg is not None:
        loop.note("weights resident for the loop (hsdp.resident): gathered once, resharded after")
        with hsdp.resident(model):
            latents, seconds = denoise(model, x_t, contexts, args.num_inference_steps, loop, args.guidance_scale,
                                       groups)
    else:
        latents, seconds = denoise(model, x_t, contexts, args.num_inference_steps, loop, args.guidance_scale, groups)
    loop.done()

    # Measured before verification, which builds a whole model on rank 0.
    per_rank = gather_ints(world, [held, peak_rss_bytes()])

    status = 0
    if is_rank0:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        np.save(args.output, latents)
        verify = _verify(args, x_t, contexts, latents, groups.sp is not None) if args.verify else None
        report = _report(args, parallel, model, per_rank, seconds, verify, groups, tokens, local_tokens)
        print("\n" + format_table("text_to_video report", report_rows(report)), flush=True)
        json_path = args.output.with_suffix(".json")
        write_json(json_path, report)
        print(f"latents: {args.output}  report: {json_path}", file=sys.stderr)
        if verify is not None and not verify["ok"]:
            status = EXIT_MISMATCH
    # Every rank leaves with rank 0's verdict, so a plain mpiexec reports it too.
    return broadcast_int(world, status)


def _report(
    args: argparse.Namespace,
    parallel: DiffusionParallelConfig,
    model: Any,
    per_rank: np.ndarray,
    seconds: list[float],
    verify: dict[str, Any] | None,
    groups: par.ParallelGroups,
    tokens: int,
    local_tokens: int,
) -> dict[str, Any]:
    params = _param_bytes(model, args.param_dtype)
    # Sharded, a rank holds the storage dtype; unsharded, float32 arrays (see unsharded_model).
    sharded = parallel.use_hsdp
    return build_report(
        args, parallel, per_rank, seconds, verify, params=params,
        whole_bytes=params["unsharded_bytes"] if sharded else params["unsharded_bytes_float32"],
        ratio_of=args.param_dtype if sharded else "float32",
        latent_shape=[args.batch, model.config.in_channels, args.frames, args.height, args.width],
        sequence_parallel={"ulysses_degree": groups.ulysses_degree, "ring_degree": groups.ring_degree,
                           "tokens": tokens,
                           "tokens_per_rank": local_tokens},
        cfg={"guidance_scale": args.guidance_scale, "cfg_parallel_size": groups.cfg_degree},
        gathers=hsdp.residency_stats(model) if sharded else None,
    )


if __name__ == "__main__":
    sys.exit(main())
