"""What the offline pipelines share: their common flags, progress lines, memory, and the
final report (table and JSON).

Kept apart from text_to_video.py and text_to_video_wan.py so that each pipeline reads like a
pipeline.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Shared with `hsdp generate`, re-exported for the pipelines here.
from hsdp.cli.report import (  # noqa: F401
    broadcast_int,
    fmt_bytes,
    format_table,
    gather_ints,
    peak_rss_bytes,
    reset_peak_rss,
    write_json,
)


def add_run_args(p: argparse.ArgumentParser, presets: Sequence[str], default_output: str,
                 checkpoint_what: str) -> None:
    """The flags both pipelines take (the parallel flags are added by the caller)."""
    p.add_argument("--preset", default="small", choices=list(presets), help="model size (default: %(default)s)")
    p.add_argument("--num-inference-steps", type=int, default=8, metavar="N",
                   help="denoising steps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights, the noise and the text (default: %(default)s)")
    p.add_argument("--output", type=Path, default=Path(default_output), metavar="PATH",
                   help="final latents (.npy); the report goes next to it as .json (default: %(default)s)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("outputs/checkpoints"), metavar="DIR",
                   help=f"where the model's {checkpoint_what} is written on first use and loaded from "
                   "(default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="videos per run (default: %(default)s)")
    p.add_argument("--frames", type=int, default=4, help="latent frames (default: %(default)s)")
    p.add_argument("--height", type=int, default=32, help="latent height (default: %(default)s)")
    p.add_argument("--width", type=int, default=32, help="latent width (default: %(default)s)")
    p.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype the weights are stored (and gathered) in (default: %(default)s)")
    p.add_argument("--verify", action="store_true",
                   help="also run the loop unsharded on rank 0 and report the largest difference")
    p.add_argument("--resident", action="store_true",
                   help="gather the sharded weights once and keep them for the whole denoising loop "
                   "(hsdp.resident): no gathers per step, the whole model per rank while it runs")


def add_guidance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--guidance-scale", type=float, default=5.0,
                   help="classifier-free guidance scale (default %(default)s, as in Wan); 1 runs the "
                        "conditional branch only")


def check_guidance_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.guidance_scale <= 0:
        p.error(f"--guidance-scale must be positive, got {args.guidance_scale}")
    if args.cfg_parallel_size == 2 and args.guidance_scale == 1.0:
        p.error("--cfg-parallel-size 2 runs the two branches of classifier-free guidance on separate ranks, "
                "but --guidance-scale 1 has only one; use a scale above 1 or --cfg-parallel-size 1")


def check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checked before any rank builds a model, so a typo costs nothing."""
    for name in ("num_inference_steps", "batch", "frames", "height", "width"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.output.suffix != ".npy":  # np.save would add it anyway; keep the report path in step
        args.output = args.output.with_name(args.output.name + ".npy")


EXIT_MISMATCH = 1  # --verify found a difference
EXIT_CONFIG = 2  # a configuration error, or a degree the runtime cannot run
SP_TOLERANCE = 1e-5  # relative, once the tokens are split (a product over fewer rows rounds differently)


# --verify below float32 with the tokens split (issue 32's criterion): the split run may be at
# most this many times as far from the float32 unsharded loop as the unsharded loop in the
# run's own dtype is. Measured on Wan in bfloat16 (docs/performance.md, "Ring attention in
# bfloat16"): ring 2 and Ulysses 2 x ring 2, tiny and small presets, 0.994-1.002, with the ring
# blocks merged in float32 and before that (each block rounded to bfloat16) alike; Ulysses
# alone is bit-exact (1.0). Both errors are ~1.2 % there, and a split run's own rounding moves
# its error by under 1 % of itself. The bound is loose on these random-weight models: a ring
# that dropped the other rank's keys also passed (1.10 tiny, 1.05 small), so the float32 run's
# 1e-5 (which flags it at 1.1e-2) stays the correctness check.
HALF_ERROR_FACTOR = 1.5


def compare(result: np.ndarray, reference: np.ndarray, sequence_parallel: bool) -> dict[str, Any]:
    """--verify's verdict: exact is required unless the tokens were split (SP_TOLERANCE)."""
    diff = float(np.max(np.abs(result - reference)))
    rel = diff / max(float(np.max(np.abs(reference))), 1e-30)
    tolerance = SP_TOLERANCE if sequence_parallel else None
    exact = diff == 0.0  # NaN compares unequal: not exact
    ok = exact if tolerance is None else bool(rel <= tolerance)
    return {"max_abs_diff": diff, "rel_diff": rel, "exact": exact, "tolerance": tolerance, "ok": ok}


def rel_l2(result: np.ndarray, reference: np.ndarray) -> float:
    """The relative L2 error ||result - reference|| / ||reference||."""
    return float(np.linalg.norm(result - reference) / max(float(np.linalg.norm(reference)), 1e-30))


def compare_to_float32(result: np.ndarray, reference: np.ndarray, reference_f32: np.ndarray) -> dict[str, Any]:
    """--verify's verdict below float32 with the tokens split: ``result`` (the split run) must
    be within HALF_ERROR_FACTOR x the error of ``reference`` (the unsharded loop in the same
    dtype), both measured against ``reference_f32`` (the unsharded loop in float32). The
    difference from ``reference`` is still reported, as ``compare`` does."""
    verdict = compare(result, reference, sequence_parallel=True)
    sharded, unsharded = rel_l2(result, reference_f32), rel_l2(reference, reference_f32)
    bound = HALF_ERROR_FACTOR * unsharded
    verdict.update(
        vs_float32={"sharded_rel_l2": sharded, "unsharded_rel_l2": unsharded,
                    "ratio": sharded / max(unsharded, 1e-30), "factor": HALF_ERROR_FACTOR, "bound": bound},
        tolerance=bound, ok=bool(sharded <= bound))  # NaN compares false: not ok
    return verdict


def config_error(prog: str, is_rank0: bool, message: str) -> int:
    """Every rank reaches the same verdict from the same arguments: rank 0 alone says it, in
    one write so that other ranks' output cannot split the line."""
    if is_rank0:
        sys.stderr.write(f"{prog}: error: {message}\n")
        sys.stderr.flush()
    return EXIT_CONFIG


def timing(seconds: list[float]) -> dict[str, Any]:
    later = seconds[1:]
    return {
        "steps": len(seconds),
        "first_step_seconds": seconds[0],
        # The first step also records the prefetch order and warms caches: reported apart.
        "seconds_per_step": sum(later) / len(later) if later else None,
        "step_seconds": seconds,
    }


def build_report(args: argparse.Namespace, parallel: Any, per_rank: np.ndarray, seconds: list[float],
                 verify: dict[str, Any] | None, *, params: dict[str, int], whole_bytes: int, ratio_of: str,
                 latent_shape: list[int], gathers: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """The report both pipelines write: ``per_rank`` rows are (held bytes, peak RSS);
    ``gathers`` is ``hsdp.residency_stats(model)`` of a sharded model (gathers per step,
    bytes per gather, what a residency budget kept)."""
    sharded = parallel.use_hsdp
    held = [int(v) for v in per_rank[:, 0]]
    return {
        "world_size": int(per_rank.shape[0]),
        "mesh": {"replicate": parallel.hsdp_replicate_size, "shard": parallel.hsdp_shard_size} if sharded else None,
        "hsdp_mode": parallel.hsdp_mode,
        "parallel": parallel.describe(),
        "parallel_config": parallel.to_dict(),
        **extra,
        "preset": args.preset,
        "param_dtype": args.param_dtype,
        "resident": bool(args.resident and sharded),
        "seed": args.seed,
        "latent_shape": latent_shape,
        "params": params,
        "held_bytes_per_rank": held,
        "held_ratio": max(held) / whole_bytes,
        "held_ratio_of": ratio_of,
        "expected_ratio": 1 / parallel.hsdp_shard_size if sharded else 1.0,
        "peak_rss_bytes_per_rank": [int(v) for v in per_rank[:, 1]],
        "timing": timing(seconds),
        "gathers": gathers,
        "verify": verify,
        "output": str(args.output),
    }


class Progress:
    """Progress of a long phase, printed on one rank only (stderr: stdout stays the report)."""

    def __init__(self, enabled: bool, label: str, total: int = 0) -> None:
        self.enabled = enabled
        self.label = label
        self.total = total
        self._start = time.perf_counter()

    def note(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stderr, flush=True)

    def step(self, done: int, seconds: float) -> None:
        """One line per step: the step's own time and the time left at the mean pace."""
        elapsed = time.perf_counter() - self._start
        eta = elapsed / done * (self.total - done)
        self.note(f"{self.label} {done}/{self.total}  {seconds:.2f} s/step  (eta {eta:.0f} s)")

    def done(self) -> None:
        self.note(f"{self.label}: done in {time.perf_counter() - self._start:.2f} s")


def _held_text(report: dict[str, Any]) -> str:
    held = report["held_bytes_per_rank"]
    low, high = min(held), max(held)
    amount = fmt_bytes(high) if low == high else f"{fmt_bytes(low)} .. {fmt_bytes(high)}"
    text = f"{amount} = {report['held_ratio']:.3f} x the {report['held_ratio_of']} model"
    if report["expected_ratio"] < 1:
        text += f" (1/S = {report['expected_ratio']:.3f})"
    return text


def _verify_text(verify: dict[str, Any] | None) -> str:
    if verify is None:
        return "not run (pass --verify)"
    text = f"max |diff| vs an unsharded run = {verify['max_abs_diff']:.3g}"
    if verify.get("tolerance") is None:
        return text + f" ({'exact' if verify['exact'] else 'MISMATCH'})"
    verdict = "within" if verify["ok"] else "MISMATCH: above"
    if "vs_float32" in verify:  # below float32 with a split: judged against a float32 unsharded run
        f32 = verify["vs_float32"]
        return text + f"; relative L2 vs an unsharded float32 run {f32['sharded_rel_l2']:.3g}, " \
            f"unsharded in this dtype {f32['unsharded_rel_l2']:.3g}, ratio {f32['ratio']:.3f} " \
            f"({verdict} {f32['factor']:g}x = {f32['bound']:.3g})"
    if "rel_l2" in verify:  # a float8 wire: judged by the relative L2 error of the latents
        return text + f", relative L2 {verify['rel_l2']:.3g} with a {verify['wire_dtype']} wire " \
            f"({verdict} {verify['tolerance']:g})"
    return text + f", relative {verify['rel_diff']:.3g} ({verdict} {verify['tolerance']:g})"


def _parallel_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """Sequence parallel and CFG rows, for a pipeline that reports them."""
    rows = []
    sp = report.get("sequence_parallel")
    if sp is not None:
        degrees = [f"{name}={sp.get(f'{name}_degree', 1)}" for name in ("ulysses", "ring")
                   if sp.get(f"{name}_degree", 1) > 1]
        rows.append(("tokens per rank", f"{sp['tokens_per_rank']} of {sp['tokens']}"
                     + (f" ({', '.join(degrees)})" if degrees else "")))
    cfg = report.get("cfg")
    if cfg is not None:
        if cfg["guidance_scale"] == 1.0:
            rows.append(("classifier-free guidance", "off (scale 1)"))
        else:
            where = ("one branch per rank (cfg parallel)" if cfg["cfg_parallel_size"] > 1
                     else "both branches on every rank")
            rows.append(("classifier-free guidance", f"scale {cfg['guidance_scale']:g}, {where}"))
    return rows


def _later_steps(steps: int) -> str:
    return "step 2" if steps == 2 else f"steps 2-{steps}"


def report_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's (label, value) rows, in reading order."""
    mesh = report["mesh"]
    params = report["params"]
    steps = report["timing"]
    rows = [
        ("world size", str(report["world_size"])),
        ("mesh (replicate x shard)", f"{mesh['replicate']} x {mesh['shard']}" if mesh else "none (unsharded)"),
        ("parallel config", report["parallel"]),
        *_parallel_rows(report),
        ("model", f"{report['preset']}: {params['count']:,} parameters, stored as {report['param_dtype']}"),
        (f"unsharded params ({report['param_dtype']})", fmt_bytes(params["unsharded_bytes"])),
    ]
    if report["param_dtype"] != "float32":
        rows.append(("unsharded params (float32)", fmt_bytes(params["unsharded_bytes_float32"])))
    rows.append(("params held per rank", _held_text(report)))
    for rank, rss in enumerate(report["peak_rss_bytes_per_rank"]):
        rows.append((f"peak RSS, rank {rank}", fmt_bytes(rss)))
    mean = steps["seconds_per_step"]
    if report["mesh"]:
        kept = bool((report.get("gathers") or {}).get("resident_units"))
        rows.append(("weights during the loop", "resident (gathered once)" if report.get("resident")
                     else "gathered per unit, prefetched, resharded after each forward"
                     + (" (but the units kept resident)" if kept else "")))
    g = report.get("gathers")
    if g:
        # a step may run several forwards (both CFG branches): counted per forward
        rows.append(("gathers per forward", f"{g['gathers_per_forward']} of {g['units']} units, "
                     f"{fmt_bytes(g['bytes_per_gather'])} each; {g['last_forward_gathers']} in the last forward"))
        kept = ", ".join(g["resident_units"]) or "none"
        rows.append(("kept resident (budget)", f"{kept} ({fmt_bytes(g['resident_bytes'])})" if g["budget"] is not None
                     else "no residency budget"))
    rows.append(
        (
            "seconds per step",
            (f"{mean:.3f} (mean of {_later_steps(steps['steps'])})" if mean is not None else "n/a (one step)")
            + f"; first step {steps['first_step_seconds']:.3f}",
        )
    )
    rows.append(("verify", _verify_text(report["verify"])))
    return rows


