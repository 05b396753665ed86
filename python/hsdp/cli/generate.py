"""``hsdp generate``: prompt to video (or image) from a diffusers pipeline folder, sharded.

    hsdp generate --model DIR --prompt "a cat in the snow" --use-hsdp --hsdp-shard-size 4 \\
        --output outputs/cat.mp4

The folder is loaded with :func:`hsdp.pipelines.load_pipeline` (transformers and text
encoders sharded across the ranks, the rest replicated) and run with
:func:`hsdp.pipelines.generate`: every rank runs the stock diffusers ``pipe(...)`` call, rank 0
alone decodes and writes ``--output``. The number of ranks follows from the parallel flags;
run from a plain shell, the command starts them itself through :mod:`hsdp.launch`; inside a
job that ``mpiexec``, ``hsdp.launch`` or ``torchrun`` started, it runs as the rank it is (the
job must have the size the flags ask for).

``--verify`` makes rank 0 also run the stock, unsharded pipeline from the same folder with
the same seed and compare the frames (largest absolute difference on [0, 1] values). In
bfloat16 or float16 the reference's sharded components store their weights and cast their
inputs as hsdp does (:func:`hsdp.cli.verify.reference_pipeline`), so the frames agree
there too.

Exit status: 0 on success, 1 when ``--verify`` finds a difference above the tolerance, 2 for
bad input (refused on every rank before anything is loaded).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hsdp.cli.base import UsageError, add_load_args, command_main, start_rank
from hsdp.cli.cache_spec import CACHE_HELP
from hsdp.cli.compile_mode import apply_compile_flags, check_compile_folder
from hsdp.cli.folder import FolderError, PipelineFolder, read_folder
from hsdp.cli.media import SUFFIXES, check_suffix, write_output
from hsdp.cli.ranks import launch_self
from hsdp.cli.verify import reference_pipeline
from hsdp.engine.config import DiffusionParallelConfig
from hsdp.hub import HubError, resolve_model_flag

__all__ = ["UsageError", "build_parser", "main"]

PROG = "hsdp generate"
EXIT_MISMATCH = 1
# --verify's default tolerance on [0, 1] frames. The reference computes what the sharded run
# computes (reference_pipeline), in every dtype, so only summation order may differ.
VERIFY_TOLERANCE = 1e-4


def _gpu_peak_bytes(torch: Any, held: int) -> int:
    """The GPU memory this rank held at its peak: torch's allocator's peak plus hsdp's own
    (cudaMalloc, beside torch's allocator, so torch's statistics never see it): the `held`
    bytes of the sharded components (their shards' device copies) and the gather buffers at
    their peak. A bound from above: the peaks need not fall at the same moment."""
    from hsdp import _C

    return int(torch.cuda.max_memory_allocated()) + held + int(_C.memory_stats()["peak_unsharded_bytes"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Prompt to video (or image) from a diffusers pipeline folder, the transformers' and "
        "text encoders' weights sharded across ranks. The ranks the parallel flags need are started "
        "through hsdp.launch, unless this already runs inside mpiexec, hsdp.launch or torchrun.",
        epilog="example: hsdp generate --model tiny-wan22 --prompt 'a cat in the snow' --use-hsdp "
        "--hsdp-shard-size 2 --height 32 --width 32 --num-frames 5 --output outputs/cat.mp4",
    )
    p.add_argument("--prompt", action="append", default=None,
                   help="the text prompt; repeat it for several outputs (NAME-0, NAME-1, ... in prompt order, "
                   "seeded --seed + i), spread over the lanes with --data-parallel-size")
    p.add_argument("--prompt-file", type=Path, default=None, metavar="FILE",
                   help="prompts, one a line (blank lines skipped), after any --prompt")
    p.add_argument("--negative-prompt", default=None, help="the negative prompt (default: the pipeline's)")
    p.add_argument("--image", type=Path, default=None, metavar="FILE",
                   help="the first frame, for an image-to-video folder (WanImageToVideoPipeline)")
    p.add_argument("--num-inference-steps", type=int, default=None, metavar="N",
                   help="denoising steps (default: the pipeline's)")
    p.add_argument("--guidance-scale", type=float, default=None, metavar="G",
                   help="guidance scale (default: the pipeline's); Wan: classifier-free guidance, off at 1; "
                   "Flux: the distilled guidance embedding")
    p.add_argument("--true-cfg-scale", type=float, default=None, metavar="G",
                   help="Flux only: classifier-free guidance with --negative-prompt, on above 1 "
                   "(default: the pipeline's, 1)")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the pipeline's)")
    p.add_argument("--width", type=int, default=None, help="pixels (default: the pipeline's)")
    p.add_argument("--num-frames", type=int, default=None, metavar="N",
                   help="frames of a video (default: the pipeline's)")
    p.add_argument("--fps", type=int, default=None, help="frames per second of a written video (default 16)")
    p.add_argument("--seed", type=int, default=0,
                   help="generator=torch.Generator('cpu').manual_seed(SEED), the same on every rank "
                   "(default: %(default)s)")
    p.add_argument("--output", type=Path, default=None, metavar="FILE",
                   help="written by rank 0: .mp4 or .gif (video), .png (image models), .npy (the raw [0, 1] "
                   "frames); default outputs/generate.mp4 or .png. The run report goes beside it as .json")
    p.add_argument("--cache", default=None, metavar="KIND[:ARGS]", help=CACHE_HELP + "; --verify's stock "
                   "pipeline runs the same cache")
    p.add_argument("--verify", action="store_true",
                   help="rank 0 also runs the stock unsharded pipeline and compares the frames; exit 1 "
                   "on a difference above --verify-tolerance (with --hsdp-wire-dtype: on a relative L2 error "
                   "above the float8 wire's documented bound, 0.05)")
    p.add_argument("--verify-tolerance", type=float, default=VERIFY_TOLERANCE, metavar="T",
                   help="largest allowed |difference| on [0, 1] frames (default %(default)g)")
    add_load_args(p, model_required=True)
    return p


# ----------------------------------------------------------------------------- checks


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def check_args(args: argparse.Namespace) -> tuple[PipelineFolder, DiffusionParallelConfig]:
    """Everything that can be checked from the flags and the folder's JSON files alone."""
    try:
        args.model = resolve_model_flag(args.model, args.revision)  # a hub id: its cached snapshot
        folder = read_folder(args.model)
    except (FolderError, HubError) as exc:
        raise UsageError(str(exc)) from None
    kind = folder.output
    if args.output is None:
        args.output = Path("outputs") / ("generate.mp4" if kind == "video" else "generate.png")
    message = check_suffix(args.output, kind, folder.class_name)
    if message:
        raise UsageError(message)
    if args.output.exists() and args.output.is_dir():
        raise UsageError(f"--output {args.output} is a folder; give a file name ({', '.join(SUFFIXES[kind])})")
    _check_writable(args.output)
    _positive(args, "num_inference_steps", "height", "width", "num_frames", "fps")
    prompts = list(args.prompt or [])
    if args.prompt_file is not None:
        try:
            prompts += [line.strip() for line in args.prompt_file.read_text().splitlines() if line.strip()]
        except OSError as exc:
            raise UsageError(f"--prompt-file {args.prompt_file}: {exc.strerror or exc}") from None
    if not prompts:
        raise UsageError("give a prompt: --prompt TEXT (repeatable) or --prompt-file FILE")
    for i, prompt in enumerate(prompts):
        if not prompt.strip():
            raise UsageError("--prompt is empty" if len(prompts) == 1 else
                             f"prompt {i} is empty (counted from 0: each --prompt, then --prompt-file's lines)")
    args.prompts = prompts
    for name in ("height", "width"):
        value = getattr(args, name)
        if value is not None and value % folder.spatial_multiple:
            raise UsageError(
                f"--{name} {value} is not a multiple of {folder.describe_multiple()} for {folder.class_name} "
                f"in {folder.path}; try {max(1, round(value / folder.spatial_multiple)) * folder.spatial_multiple}")
    if kind == "image":
        for flag, value in (("--num-frames", args.num_frames), ("--fps", args.fps)):
            if value is not None:
                raise UsageError(f"{flag} is for video pipelines; {folder.class_name} makes one image")
    elif args.num_frames is not None and folder.temporal_factor and (args.num_frames - 1) % folder.temporal_factor:
        t = folder.temporal_factor
        raise UsageError(f"--num-frames {args.num_frames}: {folder.class_name}'s VAE needs num_frames - 1 to be a "
                         f"multiple of {t} (e.g. {(args.num_frames - 1) // t * t + 1} or "
                         f"{((args.num_frames - 1) // t + 1) * t + 1})")
    if folder.takes_image and args.image is None:
        raise UsageError(f"{folder.class_name} in {folder.path} is image-to-video: give the first frame with --image FILE")
    if args.image is not None:
        if not folder.takes_image:
            raise UsageError(f"--image is for image-to-video folders; {folder.class_name} in {folder.path} "
                             "is text-to-" + kind)
        _check_image(args.image)
    if args.guidance_scale is not None and not (args.guidance_scale > 0 and math.isfinite(args.guidance_scale)):
        raise UsageError(f"--guidance-scale must be a positive number, got {args.guidance_scale}")
    if not args.verify_tolerance >= 0:
        raise UsageError(f"--verify-tolerance must be >= 0, got {args.verify_tolerance}")
    try:
        config = DiffusionParallelConfig.from_cli_args(args)
        config.require_supported()
    except (ValueError, NotImplementedError) as exc:
        raise UsageError(str(exc)) from None
    _check_sequence_split(args, folder, config)
    try:
        check_compile_folder(apply_compile_flags(args), folder)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.cache is not None:
        from hsdp.cli.cache_spec import parse_cache

        try:
            parse_cache(args.cache, num_inference_steps=args.num_inference_steps, model=folder.class_name)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    flux = folder.class_name.startswith("Flux")
    if args.true_cfg_scale is not None:
        if not flux:
            raise UsageError(f"--true-cfg-scale is for Flux pipelines; {folder.class_name} takes --guidance-scale")
        if not (args.true_cfg_scale > 0 and math.isfinite(args.true_cfg_scale)):
            raise UsageError(f"--true-cfg-scale must be a positive number, got {args.true_cfg_scale}")
    if config.cfg_parallel_size == 2:
        # The two branches exist only with guidance on; split nothing rather than run it twice.
        why = "use --cfg-parallel-size 1, or turn guidance on"
        if flux and not (args.true_cfg_scale is not None and args.true_cfg_scale > 1 and args.negative_prompt):
            raise UsageError("--cfg-parallel-size 2 runs the two branches of classifier-free guidance on separate "
                             "ranks, but FluxPipeline guides only with --true-cfg-scale above 1 and a "
                             f"--negative-prompt; {why}")
        if not flux and args.guidance_scale is not None and args.guidance_scale <= 1.0:
            raise UsageError(f"--cfg-parallel-size 2 runs the two branches of classifier-free guidance on separate "
                             f"ranks, but --guidance-scale {args.guidance_scale:g} turns guidance off; {why}")
    return folder, config


def _check_sequence_split(args: argparse.Namespace, folder: PipelineFolder, config: DiffusionParallelConfig) -> None:
    """Ulysses splits the heads and sequence parallel the tokens: both known from the folder's
    config files and the sizes, so refused here, once, before any rank starts."""
    for name, heads in folder.heads:
        if heads % config.ulysses_degree:
            raise UsageError(
                f"--ulysses-degree {config.ulysses_degree} splits the attention heads across its ranks, and "
                f"{folder.path / name / 'config.json'} has num_attention_heads={heads}, not divisible by it; "
                f"choose a degree that divides {heads}, or split the tokens with --ring-degree")
    sp = config.sequence_parallel_size
    if sp > 1 and args.height is not None and args.width is not None:
        tokens = folder.tokens(args.height, args.width, args.num_frames)
        if tokens < sp:
            raise UsageError(
                f"--ulysses-degree {config.ulysses_degree} x --ring-degree {config.ring_degree} splits the "
                f"{tokens} image tokens of --height {args.height} --width {args.width}"
                + (f" --num-frames {args.num_frames}" if args.num_frames is not None else "")
                + f" over {sp} ranks, more ranks than tokens; use a smaller degree or a larger size")


def _check_writable(output: Path) -> None:
    """The file can be made: its nearest existing folder is a writable folder (rank 0 makes
    the missing ones when it writes)."""
    folder = output.absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"--output {output}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--output {output}: cannot write in {folder}")


def _check_image(path: Path) -> None:
    if not path.is_file():
        raise UsageError(f"--image {path}: no such file")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.verify()
    except (UnidentifiedImageError, OSError) as exc:
        raise UsageError(f"--image {path}: not an image PIL can read ({exc})") from None


# ----------------------------------------------------------------------------- the run


class StepClock:
    """``callback_on_step_end``: the time each denoising step ends."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ends: list[float] = []

    def __call__(self, pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        self.ends.append(time.perf_counter())
        return callback_kwargs

    def timing(self) -> dict[str, Any]:
        later = [b - a for a, b in zip(self.ends, self.ends[1:])]
        return {
            "steps": len(self.ends),
            # The first step also encodes the prompt, prepares latents and records the prefetch order
            "first_step_seconds": self.ends[0] - self.start if self.ends else None,
            "seconds_per_step": sum(later) / len(later) if later else None,
            "step_seconds": later,
        }


def call_kwargs(args: argparse.Namespace, folder: PipelineFolder) -> dict[str, Any]:
    """The stock pipeline call's keyword arguments, as a diffusers user writes them (without the
    generator, which is fresh for each call)."""
    prompts = args.prompts
    kwargs: dict[str, Any] = {"prompt": prompts[0] if len(prompts) == 1 else prompts, "output_type": "np"}
    for name in ("negative_prompt", "num_inference_steps", "guidance_scale", "true_cfg_scale", "height", "width",
                 "num_frames"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    if args.image is not None:
        from diffusers.utils import load_image

        kwargs["image"] = load_image(str(args.image))
    return kwargs


def _generator(seed: int) -> Any:
    import torch

    return torch.Generator("cpu").manual_seed(seed)


def outputs_of(args: argparse.Namespace) -> list[Path]:
    """Where each prompt's output goes: --output itself for one prompt, NAME-i.SUFFIX for several."""
    if len(args.prompts) == 1:
        return [args.output]
    return [args.output.with_name(f"{args.output.stem}-{i}{args.output.suffix}") for i in range(len(args.prompts))]


def _generators(args: argparse.Namespace) -> Any:
    """One generator for one prompt; several prompts: one each, seeded --seed + i."""
    if len(args.prompts) == 1:
        return _generator(args.seed)
    return [_generator(args.seed + i) for i in range(len(args.prompts))]


def frames_of(result: Any, folder: PipelineFolder, index: int = 0) -> Any:
    """Output `index`'s frames (F, H, W, 3), or its image (H, W, 3), as float32 numpy."""
    import numpy as np

    out = result.frames[index] if folder.output == "video" else result.images[index]
    if hasattr(out, "detach"):
        out = out.detach().float().cpu().numpy()
    return np.asarray(out, dtype=np.float32)


def _held_per_component(pipe: Any) -> dict[str, tuple[int, int, bool]]:
    """By component: (bytes this rank holds outside a forward, bytes of the whole model, sharded)."""
    from hsdp.pipelines import pipeline_state

    return {name: (c.local_bytes, c.bytes, c.sharded) for name, c in pipeline_state(pipe).components.items()}


def _verify(args: argparse.Namespace, folder: PipelineFolder, pipe: Any, kwargs: dict[str, Any],
            frames: Sequence[Any], dtype: Any) -> dict[str, Any]:
    """Rank 0: the reference pipeline called for each prompt alone, with a fresh generator of its
    seed; the verdict over all of them (the largest difference)."""
    import numpy as np

    stock = reference_pipeline(folder.path, pipe, dtype, args.device)
    stock.set_progress_bar_config(disable=True)
    if args.cache is not None:
        for name in ("transformer", "transformer_2"):
            if getattr(stock, name, None) is not None:
                getattr(stock, name).enable_cache(_cache_config(args, folder))
    started = time.perf_counter()
    tolerance = args.verify_tolerance
    wire_bound = _wire_bound(args)
    diff = 0.0
    sq_diff = sq_ref = 0.0
    for i, got in enumerate(frames):
        one = {**kwargs, "prompt": args.prompts[i]}
        reference = frames_of(stock(**one, generator=_generator(args.seed + i)), folder)
        if reference.shape != got.shape:
            return {"ok": False, "max_abs_diff": None, "tolerance": tolerance,
                    "seconds": time.perf_counter() - started,
                    "error": f"output {i}: shape {list(got.shape)} against the stock pipeline's {list(reference.shape)}"}
        diff = max(diff, float(np.max(np.abs(got - reference))))
        sq_diff += float(np.sum(np.square(got.astype(np.float64) - reference)))
        sq_ref += float(np.sum(np.square(reference.astype(np.float64))))
    rel_l2 = (sq_diff / sq_ref) ** 0.5 if sq_ref > 0 else (0.0 if sq_diff == 0 else float("inf"))
    ok = rel_l2 <= wire_bound if wire_bound is not None else diff <= tolerance
    return {"ok": bool(ok), "max_abs_diff": diff, "tolerance": tolerance, "rel_l2": rel_l2,
            "wire_rel_l2_bound": wire_bound, "seconds": time.perf_counter() - started,
            "reference": "stock" if args.dtype == "float32" else f"stock, {args.dtype} as hsdp stores and casts"}


def _wire_bound(args: argparse.Namespace) -> float | None:
    """The relative L2 bound --verify checks with a float8 wire (the wire's documented bound on
    a model's output, hsdp.engine.wire.OUTPUT_REL_L2_BOUND), or None without one: then the
    frames must agree within --verify-tolerance."""
    if getattr(args, "hsdp_wire_dtype", None) is None:
        return None
    from hsdp.engine.wire import OUTPUT_REL_L2_BOUND

    return OUTPUT_REL_L2_BOUND


def run(args: argparse.Namespace, folder: PipelineFolder, config: DiffusionParallelConfig) -> int:
    from hsdp.cli.compile_mode import on_gpu as device_is_gpu

    on_gpu = device_is_gpu(args.device)
    world = start_rank(args, config)  # load_pipeline picks the same backend

    import torch

    from hsdp.cli.report import (
        fmt_bytes,
        format_table,
        gather_ints,
        peak_rss_bytes,
        write_json,
    )
    from hsdp.pipelines import PipelineFolderError, generate, load_pipeline

    rank0 = world.rank == 0
    if not rank0:  # diffusers' and transformers' loading bars, once for the job
        import diffusers
        import transformers

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)

    started = time.perf_counter()
    try:  # load_pipeline checks the weights' files and the modes before reading any weight
        pipe = load_pipeline(folder.path, config, torch_dtype=dtype, device=args.device,
                             shard_text_encoders=not args.replicate_text_encoders, progress=rank0)
    except (PipelineFolderError, NotImplementedError) as exc:
        raise UsageError(str(exc)) from None
    load_seconds = time.perf_counter() - started
    load_peak = peak_rss_bytes()
    pipe.set_progress_bar_config(disable=not rank0)  # diffusers' step bar, once
    if args.cache is not None:  # on every transformer, deciding per request (hsdp.pipelines.cache)
        from hsdp.pipelines.cache import enable_cache

        enable_cache(pipe, _cache_config(args, folder))
    from hsdp.cli.compile_mode import compile_pipeline, compile_seconds

    compiled = compile_pipeline(pipe, args.compile)  # in place (check_args checked the mode against the folder)

    kwargs = call_kwargs(args, folder)
    clock = StepClock()
    called = time.perf_counter()
    result = generate(pipe, **kwargs, generator=_generators(args), callback_on_step_end=clock)
    call_seconds = time.perf_counter() - called
    timing = clock.timing()
    timing["call_seconds"] = call_seconds
    timing["outputs_per_minute"] = 60 * len(args.prompts) / call_seconds
    # the progress said each transformer's warm-up as it ended (compile_mode's log); the report's row says the total
    compile_report = {"mode": args.compile, "transformers": compiled,
                      "compile_seconds": compile_seconds() if compiled else None}
    held = _held_per_component(pipe)
    cuda_peak = _gpu_peak_bytes(torch, sum(h[0] for h in held.values())) if on_gpu else -1
    per_rank = gather_ints(world, [load_peak, peak_rss_bytes(), sum(h[0] for h in held.values()),
                                   int(load_seconds * 1e6), cuda_peak])
    components = list(held)
    held_rows = gather_ints(world, [held[c][0] for c in components]) if components else None
    cache_rows = _gather_cache_counts(pipe, world, gather_ints) if args.cache is not None else None

    if not rank0:
        return 0
    paths = outputs_of(args)
    frames = [frames_of(result, folder, i) for i in range(len(paths))]
    for one, path in zip(frames, paths, strict=True):
        write_output(one, path, args.fps or 16)
    verify = _verify(args, folder, pipe, kwargs, frames, dtype) if args.verify else None
    report = {
        "pipeline": folder.class_name,
        "model": str(folder.path),
        "parallel": config.describe(),
        "parallel_config": config.to_dict(),
        "world_size": world.size,
        "dtype": args.dtype,
        "seed": args.seed,
        "call": {k: v for k, v in kwargs.items() if k not in ("image", "output_type")},
        "image": str(args.image) if args.image is not None else None,
        "output": str(args.output),
        "outputs": [str(p) for p in paths],
        "frames_shape": list(frames[0].shape),
        "load_seconds_per_rank": [int(v) / 1e6 for v in per_rank[:, 3]],
        "load_peak_rss_bytes_per_rank": [int(v) for v in per_rank[:, 0]],
        "peak_rss_bytes_per_rank": [int(v) for v in per_rank[:, 1]],
        "cuda_peak_bytes_per_rank": [int(v) for v in per_rank[:, 4]] if cuda_peak >= 0 else None,
        "held_bytes_per_rank": [int(v) for v in per_rank[:, 2]],
        "held_bytes_per_component_per_rank": (
            {c: [int(v) for v in held_rows[:, i]] for i, c in enumerate(components)} if held_rows is not None else {}
        ),
        "components": {c: {"bytes": held[c][1], "sharded": held[c][2]} for c in components},
        "timing": timing,
        "compile": compile_report,
        "verify": verify,
        "cache": {"spec": args.cache, **cache_rows} if cache_rows is not None else None,
    }
    write_json(args.output.with_suffix(".json"), report)
    print(format_table(f"{PROG}: {folder.class_name} from {folder.path}", _rows(report, fmt_bytes)), flush=True)
    if verify is not None and not verify["ok"]:
        return EXIT_MISMATCH
    return 0


def _cache_config(args: argparse.Namespace, folder: PipelineFolder) -> Any:
    from hsdp.cli.cache_spec import parse_cache

    return parse_cache(args.cache, num_inference_steps=args.num_inference_steps, model=folder.class_name)


def _gather_cache_counts(pipe: Any, world: Any, gather_ints: Any) -> dict[str, Any]:
    """Every rank's computed and skipped forwards per transformer (a lane leader's are its
    requests', a CFG rank's its branch's)."""
    from hsdp.pipelines.cache import cache_report

    counts = cache_report(pipe) or {}
    names = sorted(counts)
    rows = gather_ints(world, [v for n in names for v in (counts[n]["computed"], counts[n]["skipped"])])
    return {"per_rank": [{n: {"computed": int(r[2 * i]), "skipped": int(r[2 * i + 1])} for i, n in enumerate(names)}
                         for r in rows]}


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _span(values: Sequence[int], fmt: Any) -> str:
    low, high = min(values), max(values)
    return fmt(high) if low == high else f"{fmt(low)} .. {fmt(high)}"


def _rows(report: dict[str, Any], fmt_bytes: Any) -> list[tuple[str, str]]:
    t = report["timing"]
    rows = [
        ("parallel config", report["parallel"]),
        ("dtype", report["dtype"]),
        ("load (seconds, slowest rank)", f"{max(report['load_seconds_per_rank']):.2f}"),
    ]
    for comp, per in report["held_bytes_per_component_per_rank"].items():
        info = report["components"][comp]
        how = f"sharded, of {fmt_bytes(info['bytes'])}" if info["sharded"] else "whole"
        rows.append((f"held per rank: {comp}", f"{_span(per, fmt_bytes)} ({how})"))
    for rank, (load, peak) in enumerate(zip(report["load_peak_rss_bytes_per_rank"], report["peak_rss_bytes_per_rank"])):
        rows.append((f"peak RSS, rank {rank}", f"{fmt_bytes(peak)} (after loading: {fmt_bytes(load)})"))
    if report["cuda_peak_bytes_per_rank"]:
        for rank, peak in enumerate(report["cuda_peak_bytes_per_rank"]):
            rows.append((f"peak GPU memory, rank {rank}", f"{fmt_bytes(peak)} (torch's allocator + hsdp's buffers)"))
    mean = t["seconds_per_step"]
    first = t["first_step_seconds"]
    rows.append(("seconds per step",
                 (f"{mean:.3f} (mean of steps 2-{t['steps']})" if mean is not None else "n/a (one step)")
                 + (f"; first step {first:.3f} (with prompt encoding)" if first is not None else "")))
    c = report["compile"]
    rows.append(("compile", "none (eager)" if not c["transformers"] else
                 f"{c['mode']}: {', '.join(c['transformers'])}; {_seconds(c['compile_seconds'])} s compiling in this "
                 "first request (its first step waits for it)"))
    if len(report["outputs"]) > 1:
        rows.append(("outputs", f"{len(report['outputs'])}: {report['outputs'][0]} .. {report['outputs'][-1]} "
                     f"{tuple(report['frames_shape'])} each"))
        rows.append(("outputs per minute", f"{t['outputs_per_minute']:.2f} ({t['call_seconds']:.2f} s for the call)"))
    else:
        rows.append(("output", f"{report['output']} {tuple(report['frames_shape'])}"))
    cache = report.get("cache")
    if cache is not None:
        for name, c in cache["per_rank"][0].items():
            rows.append((f"cache ({cache['spec']}): {name}",
                         f"{c['computed']} forwards computed, {c['skipped']} skipped (rank 0)"))
    v = report["verify"]
    if v is None:
        rows.append(("verify", "not run (pass --verify)"))
    elif v["max_abs_diff"] is None:
        rows.append(("verify", f"MISMATCH: {v['error']}"))
    else:
        verdict = "ok" if v["ok"] else "MISMATCH"
        bound = v.get("wire_rel_l2_bound")
        if bound is None:
            rows.append(("verify", f"max |diff| vs the stock pipeline = {v['max_abs_diff']:.3g} on [0, 1] frames "
                         f"({verdict}, tolerance {v['tolerance']:g})"))
        else:
            rows.append(("verify", f"relative L2 error vs the stock pipeline = {v['rel_l2']:.3g} on [0, 1] frames "
                         f"({verdict}, bound {bound:g}: the float8 wire's documented bound on a model's output, "
                         f"docs/user-guide.md; max |diff| {v['max_abs_diff']:.3g})"))
        if v["reference"] != "stock":
            rows.append(("", f"(the stock pipeline's sharded components in {report['dtype']} as hsdp stores "
                         "and casts them: FSDP2's cast_forward_inputs)"))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``hsdp generate ARGS``; returns the exit status."""
    return command_main(PROG, argv, build_parser(), check_args, run,
                        lambda n, args: launch_self(n, ["generate", *args]))
