"""Text-to-video with a stock diffusers Wan transformer, its weights sharded by HSDP.

The torch twin of ``text_to_video.py``: a diffusers ``WanTransformer3DModel`` (a small
config, random weights from ``--seed``, saved with ``save_pretrained`` on first use: no
downloads) is streamed into a model built under ``accelerate.init_empty_weights()``, each
rank reading only its own shard, then diffusers' ``FlowMatchEulerDiscreteScheduler`` runs
``--num-inference-steps`` steps from seeded noise and seeded stand-ins for the text and
negative-prompt embeddings, with classifier-free guidance (``--guidance-scale``, default
5.0). Same flags, report and JSON as the NumPy example, and every combined mode
(``--ulysses-degree``, ``--ring-degree``, ``--cfg-parallel-size``, HSDP over the same ranks).

    python -m hsdp.launch -n 4 -- examples/offline_inference/text_to_video_wan.py \\
        --use-hsdp --hsdp-shard-size 4 --verify

On GPUs (``--device cuda``: the NCCL backend, one GPU per rank, LOCAL_RANK):

    torchrun --nproc-per-node 8 examples/offline_inference/text_to_video_wan.py \\
        --device cuda --use-hsdp --hsdp-shard-size 8

``--verify`` reruns the loop on rank 0 unsharded, from the same seeded inputs, and checks
the final latents against it:

- without a sequence split (``--ulysses-degree``, ``--ring-degree``), in either dtype: equal
  bit for bit (sharding moves the weights, never the arithmetic);
- ``--param-dtype float32`` with a split: within 1e-5 relative (``SP_TOLERANCE``);
- ``--param-dtype bfloat16`` with a split: a second unsharded loop runs in float32, and the
  split run's relative L2 error against it must be at most ``HALF_ERROR_FACTOR`` (1.5) x the
  error of the unsharded bfloat16 loop against it (both errors, their ratio and the bound
  are reported). Ring attention's merge rounds differently from one whole-sequence
  attention, so bit-exactness is not the measure in half precision, but the split may not
  lose more accuracy than the unsharded model does in that dtype (a loose check on these
  random-weight models: the float32 run is the one that checks the split is right);
- ``--hsdp-wire-dtype float8_e4m3fn`` (shards held and gathered block-scaled in float8, half
  the bytes): within a relative L2 error of ``WIRE_TOLERANCE`` of the unsharded bfloat16 loop.

Exit status: 0 on success, 1 when --verify finds a difference, 2 for a configuration error
or a parallel degree the runtime cannot execute yet.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hsdp
from hsdp import parallel as par
from hsdp.config import DiffusionParallelConfig, add_parallel_args
from hsdp.distributed import init_process_group

# Modules next to this script: `python SCRIPT` and hsdp.launch both put its folder on sys.path.
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
    compare_to_float32,
    config_error,
    format_table,
    gather_ints,
    peak_rss_bytes,
    rel_l2,
    reset_peak_rss,
    report_rows,
    write_json,
)

TEXT_LEN = 16
# --verify's bound with a float8 wire: the relative L2 error of the final latents against
# the unsharded loop (docs/performance.md#float8-on-the-wire has the measured values)
WIRE_TOLERANCE = 0.05

# Wan configs by size; "base" matches the reference DiT's base preset (dim 512, 8 blocks).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
                 freq_dim=32, ffn_dim=64, num_layers=2),
    "small": dict(num_attention_heads=4, attention_head_dim=32, in_channels=16, out_channels=16, text_dim=64,
                  freq_dim=64, ffn_dim=512, num_layers=4),
    "base": dict(num_attention_heads=8, attention_head_dim=64, in_channels=16, out_channels=16, text_dim=256,
                 freq_dim=256, ffn_dim=2048, num_layers=8),
}
COMMON = dict(patch_size=(1, 2, 2), cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)


def is_block(name: str, module: Any) -> bool:
    return name.startswith("blocks.") and name.count(".") == 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Text-to-video on a diffusers Wan transformer, weights sharded with HSDP.")
    add_run_args(p, sorted(PRESETS), "outputs/text_to_video_wan.npy", "save_pretrained folder")
    add_guidance_args(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model runs (default %(default)s); cuda uses the NCCL backend, one GPU per rank")
    add_parallel_args(p)
    args = p.parse_args(argv)
    check_guidance_args(p, args)
    check_run_args(p, args)
    for name in ("height", "width"):
        if getattr(args, name) % 2:
            p.error(f"--{name} {getattr(args, name)} must be a multiple of the patch size 2")
    return args


# ------------------------------------------------------------------------------------ model


def checkpoint_dir(args: argparse.Namespace) -> Path:
    return args.checkpoint_dir / f"wan-{args.preset}-seed{args.seed}"


def ensure_checkpoint(args: argparse.Namespace, world: Any, progress: Progress) -> Path:
    """The model as a diffusers save_pretrained folder, written by rank 0 on first use into a
    temporary folder and renamed, so an interrupted write never looks complete."""
    from diffusers import WanTransformer3DModel

    folder = checkpoint_dir(args)
    if world.rank == 0 and not (folder / "config.json").exists():
        progress.note(f"writing the checkpoint {folder} (first use)")
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        torch.manual_seed(args.seed)
        WanTransformer3DModel(**PRESETS[args.preset], **COMMON).save_pretrained(tmp, max_shard_size="64MB")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    world.barrier()
    return folder


def empty_model(folder: Path) -> Any:
    import accelerate
    from diffusers import WanTransformer3DModel

    with accelerate.init_empty_weights():  # meta parameters, real (RoPE) buffers
        model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder))
    model._hsdp_shard_conditions = [is_block]  # on the instance: the stock class is enough
    return model.eval()


def unsharded_model(folder: Path, param_dtype: str) -> Any:
    """The whole model on this rank, computing what a sharded one does: the dtypes a
    ``param_dtype`` shard holds and the same input casts (hsdp's unsharded_reference)."""
    from diffusers import WanTransformer3DModel

    from hsdp.adapters.torch import unsharded_reference

    model = WanTransformer3DModel.from_pretrained(folder).eval()
    # from_pretrained leaves the weights where the file put them (mmap'd, 8-byte aligned); the
    # CPU's matrix kernels round differently on such memory than on the 64-byte-aligned
    # memory torch allocates (and hsdp's layout guarantees). Copies make the run comparable.
    for p in model.parameters():
        p.data = p.data.clone()
    model._hsdp_shard_conditions = [is_block]
    return unsharded_reference(model, param_dtype)


def build_model(args: argparse.Namespace, hsdp_cfg: Any | None, folder: Path) -> Any:
    if hsdp_cfg is None:
        return unsharded_model(folder, args.param_dtype).to(args.device)
    return hsdp.load_model_sharded(empty_model(folder), folder, hsdp_cfg, target_device=args.device)


# ------------------------------------------------------------------------------------ sampling


def initial_noise(args: argparse.Namespace, channels: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(args.seed * 1000 + 1)
    return torch.randn(args.batch, channels, args.frames, args.height, args.width, generator=g)


def text_context(args: argparse.Namespace, text_dim: int, negative: bool = False) -> torch.Tensor:
    """A seeded stand-in for the text encoder's output; `negative`: the negative prompt's."""
    g = torch.Generator().manual_seed(args.seed * 1000 + (3 if negative else 2))
    return torch.randn(args.batch, TEXT_LEN, text_dim, generator=g)


def denoise(model: Any, x: torch.Tensor, contexts: tuple[torch.Tensor, torch.Tensor], steps: int,
            progress: Progress, guidance_scale: float = 1.0,
            groups: par.ParallelGroups = par.SINGLE) -> tuple[torch.Tensor, list[float]]:
    """diffusers' flow-matching Euler scheduler, the one Wan pipelines use, with the velocity
    guided from the (conditional, negative) contexts unless the scale is 1."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from hsdp.parallel_torch import cfg_combine

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(steps)
    seconds = []
    with torch.inference_mode():
        for i, t in enumerate(scheduler.timesteps):
            start = time.perf_counter()
            tt = t.expand(x.shape[0]).to(x.device)
            if guidance_scale == 1.0:
                v = model(x, tt, contexts[0], return_dict=False)[0]
            else:
                v = cfg_combine(groups, lambda b: model(x, tt, contexts[b], return_dict=False)[0], guidance_scale)
            x = scheduler.step(v, t, x, return_dict=False)[0]
            seconds.append(time.perf_counter() - start)
            progress.step(i + 1, seconds[-1])
    return x, seconds


# ------------------------------------------------------------------------------------ report


def _param_bytes(model: Any) -> dict[str, int]:
    count = stored = 0
    for p in model.parameters():
        n = p.numel() if not hasattr(p, "_hsdp_shape") else int(np.prod(p._hsdp_shape))
        count += n
        stored += n * p.element_size()
    return {"count": count, "unsharded_bytes": stored, "unsharded_bytes_float32": count * 4}


def _held_bytes(model: Any, sharded: bool) -> int:
    if not sharded:
        return sum(p.numel() * p.element_size() for p in model.parameters())
    stats = hsdp.memory_stats()
    return stats["sharded_bytes"] + stats["whole_bytes"]


def _unsharded_loop(args: argparse.Namespace, param_dtype: str, x_t: torch.Tensor,
                    contexts: tuple[torch.Tensor, torch.Tensor]) -> np.ndarray:
    progress = Progress(True, "verify step", args.num_inference_steps)
    progress.note(f"verify: running the same loop unsharded on rank 0 ({args.device}, {param_dtype})")
    model = unsharded_model(checkpoint_dir(args), param_dtype).to(args.device)
    reference, _ = denoise(model, x_t, contexts, args.num_inference_steps, progress, args.guidance_scale)
    return reference.float().cpu().numpy()


def _verify(args: argparse.Namespace, x_t: torch.Tensor, contexts: tuple[torch.Tensor, torch.Tensor],
            result: torch.Tensor, sequence_parallel: bool) -> dict[str, Any]:
    """The module docstring's rules, by dtype."""
    got, want = result.float().cpu().numpy(), _unsharded_loop(args, args.param_dtype, x_t, contexts)
    verdict = compare(got, want, sequence_parallel)
    if args.hsdp_wire_dtype is not None:  # float8 weights: close, not equal
        error = rel_l2(got, want)
        verdict.update(wire_dtype=args.hsdp_wire_dtype, rel_l2=error, tolerance=WIRE_TOLERANCE,
                       ok=bool(error <= WIRE_TOLERANCE))
    elif sequence_parallel and args.param_dtype != "float32":  # judged against a float32 loop
        verdict = compare_to_float32(got, want, _unsharded_loop(args, "float32", x_t, contexts))
    return verdict


# ------------------------------------------------------------------------------------ main


def _config_error(is_rank0: bool, message: str) -> int:
    return config_error("text_to_video_wan", is_rank0, message)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        world = init_process_group("nccl" if args.device == "cuda" else "auto")
    except (RuntimeError, ValueError) as exc:  # no GPU; NCCL not built (NotImplementedError); a bad launch
        return config_error("text_to_video_wan", True, f"--device {args.device}: {exc}")
    is_rank0 = world.rank == 0
    logging.basicConfig(level=logging.INFO if is_rank0 else logging.WARNING, format="%(name)s: %(message)s")
    try:
        parallel = DiffusionParallelConfig.from_cli_args(args)
        parallel.check_world(world.size)
        hsdp_cfg = parallel.to_hsdp_config(param_dtype=args.param_dtype) if parallel.use_hsdp else None
        groups = par.init_parallel_groups(parallel, world)
        pt, ph, pw = COMMON["patch_size"]
        tokens = (args.frames // pt) * (args.height // ph) * (args.width // pw)
        local_tokens = tokens
        if groups.sp is not None:  # any count of at least the degree: the first ranks hold one token more
            if tokens < groups.sp.degree:
                raise ValueError(f"sequence parallel over {groups.sp.degree} ranks needs at least as many tokens; "
                                 f"--frames, --height and --width give {tokens}")
            local_tokens = -(-tokens // groups.sp.degree)
        if groups.sp is not None:
            groups.sp.check_heads(PRESETS[args.preset]["num_attention_heads"])
    except (ValueError, NotImplementedError) as exc:
        return _config_error(is_rank0, f"{type(exc).__name__}: {exc}")

    phase = Progress(is_rank0, "build")
    folder = ensure_checkpoint(args, world, phase)
    reset_peak_rss()  # writing the checkpoint materialised the model once on rank 0
    phase.note(f"loading the '{args.preset}' Wan transformer (seed {args.seed}) on {world.size} rank(s): {parallel}")
    model = build_model(args, hsdp_cfg, folder)
    if groups.sp is not None:  # the tokens split over the Ulysses/ring ranks, HSDP over the same ranks
        from hsdp.parallel_torch import apply_sequence_parallel_torch

        apply_sequence_parallel_torch(model, groups.sp)
    phase.done()
    held = _held_bytes(model, hsdp_cfg is not None)

    cfg = PRESETS[args.preset]
    x_t = initial_noise(args, cfg["in_channels"]).to(args.device)
    contexts = (text_context(args, cfg["text_dim"]).to(args.device),
                text_context(args, cfg["text_dim"], negative=True).to(args.device))
    loop = Progress(is_rank0, "step", args.num_inference_steps)
    if args.resident and hsdp_cfg is not None:
        loop.note("weights resident for the loop (hsdp.resident): gathered once, resharded after")
        with hsdp.resident(model):
            latents, seconds = denoise(model, x_t, contexts, args.num_inference_steps, loop, args.guidance_scale,
                                       groups)
    else:
        latents, seconds = denoise(model, x_t, contexts, args.num_inference_steps, loop, args.guidance_scale, groups)
    loop.done()
    per_rank = gather_ints(world, [held, peak_rss_bytes()])

    status = 0
    if is_rank0:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        np.save(args.output, latents.float().cpu().numpy())
        verify = _verify(args, x_t, contexts, latents, groups.sp is not None) if args.verify else None
        params = _param_bytes(model)
        report = build_report(args, parallel, per_rank, seconds, verify, params=params,
                              whole_bytes=params["unsharded_bytes"], ratio_of=args.param_dtype,
                              latent_shape=list(latents.shape), model="diffusers.WanTransformer3DModel",
                              sequence_parallel={"ulysses_degree": groups.ulysses_degree,
                                                 "ring_degree": groups.ring_degree, "tokens": tokens,
                                                 "tokens_per_rank": local_tokens},
                              cfg={"guidance_scale": args.guidance_scale, "cfg_parallel_size": groups.cfg_degree},
                              device=args.device,
                              gathers=hsdp.residency_stats(model) if parallel.use_hsdp else None)
        print("\n" + format_table("text_to_video_wan report", report_rows(report)), flush=True)
        json_path = args.output.with_suffix(".json")
        write_json(json_path, report)
        print(f"latents: {args.output}  report: {json_path}", file=sys.stderr)
        if verify is not None and not verify["ok"]:
            status = EXIT_MISMATCH
    return broadcast_int(world, status)


if __name__ == "__main__":
    sys.exit(main())
