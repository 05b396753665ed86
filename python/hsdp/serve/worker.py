"""The pipeline call every rank makes for each job, and the two loops around it: rank 0's
(take the next job, broadcast it, run it, record the outcome) and every other rank's (wait for
rank 0's next message, run the job it names, or stop).

A job that fails inside the model fails on every rank alike (the same inputs reach the same
check), each rank catches it, the ranks agree on the outcome (:func:`protocol.agree_outcome`),
and all move on to the next job. A rank that dies or stalls ends the whole job through the
launcher and ``HSDP_TIMEOUT``: the server goes down with that message instead of hanging.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .jobs import Job, JobStore
from .protocol import agree_outcome, recv_message, send_message

__all__ = ["FAULT_ENV", "execute", "follower_loop", "heartbeat_seconds", "leader_loop"]

log = logging.getLogger("hsdp.serve")

# Fault injection for tests and drills: a job whose prompt equals this variable's value raises
# inside the pipeline call, at the end of its first step, on every rank.
FAULT_ENV = "HSDP_SERVE_FAULT_PROMPT"


class InjectedFault(RuntimeError):
    pass


def heartbeat_seconds() -> float:
    """How often an idle rank 0 tells the others it is alive: well inside ``HSDP_TIMEOUT``, so
    that ranks waiting for the next job are not ended for waiting."""
    from hsdp.world import distributed

    timeout = distributed.get_timeout()
    return 5.0 if timeout <= 0 else max(0.05, min(5.0, timeout / 4))


def job_call(params: dict[str, Any], on_step: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The stock pipeline call of one job (with the fault injection and the progress callback)."""
    import torch

    kwargs: dict[str, Any] = {
        "prompt": params["prompt"],
        "output_type": "np",
        "generator": torch.Generator("cpu").manual_seed(int(params["seed"])),
    }
    for name in ("negative_prompt", "width", "height", "num_frames", "num_inference_steps", "guidance_scale",
                 "true_cfg_scale"):
        if params.get(name) is not None:
            kwargs[name] = params[name]
    if params["kind"] == "image" and params.get("n", 1) > 1:
        kwargs["num_images_per_prompt"] = params["n"]
    if params.get("image_b64"):
        from PIL import Image

        kwargs["image"] = Image.open(io.BytesIO(base64.b64decode(params["image_b64"]))).convert("RGB")
    fault = os.environ.get(FAULT_ENV)

    def step_end(p: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        if fault is not None and params["prompt"] == fault:
            raise InjectedFault(f"injected fault ({FAULT_ENV}) at the end of step {step}")
        if on_step is not None:
            on_step(step + 1, int(getattr(p, "_num_timesteps", 0) or params.get("num_inference_steps") or 0))
        return callback_kwargs

    kwargs["callback_on_step_end"] = step_end
    return kwargs


def use_cache(pipe: Any, params: dict[str, Any]) -> None:
    """The job's step cache (``params["cache"]``: a ``--cache`` spec, or None) on every
    transformer of this rank's pipeline, changed only when it differs from the last job's
    (MagCache's ratios depend on the step count too); the counts restart for the job."""
    from hsdp.cli.cache_spec import parse_cache
    from hsdp.pipelines.cache import enable_cache
    from hsdp.pipelines.state import PipelineState

    spec = params.get("cache")
    key = (spec, params.get("num_inference_steps") if spec and spec.startswith("magcache") else None)
    current = getattr(pipe, "_hsdp_serve_cache", (None, None))
    state = getattr(pipe, "_hsdp", None)
    if key != current:
        for name in ("transformer", "transformer_2"):
            model = getattr(pipe, name, None)
            if model is not None and current[0] is not None:
                model.disable_cache()
        if spec is not None:
            model_name = type(pipe).__name__
            enable_cache(pipe, parse_cache(spec, num_inference_steps=params.get("num_inference_steps"), model=model_name))
        object.__setattr__(pipe, "_hsdp_serve_cache", key)
    if isinstance(state, PipelineState) and state.caches:
        for watch in state.caches.values():
            watch.counts.reset()


def cache_counts(pipe: Any) -> dict[str, dict[str, int]] | None:
    """This rank's counts for the job that just ran (None: no cache)."""
    from hsdp.pipelines.cache import cache_report

    return cache_report(pipe) if getattr(pipe, "_hsdp_serve_cache", (None, None))[0] is not None else None


def execute(pipe: Any, params: dict[str, Any], on_step: Callable[[int, int], None] | None = None) -> Any:
    """Run one job's pipeline call on this rank (every rank calls it with the same ``params``);
    rank 0's output, None elsewhere."""
    from hsdp.pipelines import generate

    use_cache(pipe, params)
    return generate(pipe, **job_call(params, on_step))


def run_round(world: Any, pipe: Any, jobs: list[dict[str, Any]],
              on_step: Callable[[int, int], None] | None = None) -> tuple[list[Any], list[str | None]]:
    """Data parallel: job i of the round runs on lane i, every lane at once, the lanes gathering
    in lockstep (hsdp.pipelines.lanes.run_lanes); a job that fails (between two forwards: the
    fault injection, a bad input) fails alone. Every rank calls it with the same jobs; returns
    each job's result (on rank 0) and error (on every rank)."""
    from hsdp.pipelines.lanes import lane_groups, run_lanes

    calls = [job_call(params, on_step if i == 0 else None) for i, params in enumerate(jobs)]
    return run_lanes(pipe, calls, world, lane_groups(pipe), before=lambda i: use_cache(pipe, jobs[i]))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _save(job: Job, result: Any, output_dir: Path) -> None:
    """Rank 0: the job's video file, or its images as base64 PNGs."""
    import numpy as np

    from hsdp.cli.media import write_output

    params = job.params
    if params["kind"] == "video":
        frames = np.asarray(result.frames[0], dtype=np.float32)
        path = output_dir / f"{job.id}.mp4"
        write_output(frames, path, int(params["fps"]))
        job.output = path
        return
    from PIL import Image

    images = []
    for img in np.asarray(result.images, dtype=np.float32):
        buf = io.BytesIO()
        Image.fromarray((np.clip(img, 0.0, 1.0) * 255).round().astype(np.uint8)).save(buf, format="PNG")
        images.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    job.images = images


def leader_loop(world: Any, pipe: Any, store: JobStore, output_dir: Path) -> int:
    """Rank 0: runs jobs until the store stops accepting, then fails what is still queued and
    tells the other ranks to stop. Returns the number of jobs run."""
    beat = heartbeat_seconds()
    ran = 0
    from hsdp.pipelines.lanes import lane_groups

    groups = lane_groups(pipe)
    while True:
        job = store.next(beat)
        if job is None:
            if not store.accepting:
                break
            send_message(world, {"op": "idle"})  # keeps the waiting ranks inside HSDP_TIMEOUT
            continue
        if groups is not None:  # data parallel: up to one job per lane, all at once
            ran += _leader_round(world, pipe, store, output_dir, _fill_lanes(store, job, groups.dp_degree))
            continue
        send_message(world, {"op": "job", "id": job.id, "params": job.params})
        started = time.perf_counter()
        error: str | None = None
        try:
            result = execute(pipe, job.params, lambda step, total: store.set_progress(
                job, int(100 * step / total) if total else 0))
            _save(job, result, output_dir)
            job.cache_counts = cache_counts(pipe)
        except Exception as exc:  # noqa: BLE001 - a job's failure is its outcome, not the server's
            error = _describe(exc)
        error = agree_outcome(world, error)
        store.finish(job, error)
        ran += 1
        if error is None:
            log.info("hsdp serve: %s completed in %.2f s", job.id, time.perf_counter() - started)
        else:
            log.warning("hsdp serve: %s failed: %s", job.id, error)
    dropped = store.fail_queued("the server stopped before this job ran")
    if dropped:
        log.warning("hsdp serve: %d queued job(s) failed: the server stopped", dropped)
    send_message(world, {"op": "stop"})
    return ran


# How long a round with lanes to spare waits for more jobs: requests that arrive together (a
# client's next request just after its answer, several clients at once) share a round, at the
# cost of this much latency when fewer jobs than lanes are waiting.
FILL_SECONDS = 0.05


def _fill_lanes(store: JobStore, first: Job, lanes: int) -> list[Job]:
    jobs = [first, *store.take_more(lanes - 1)]
    deadline = time.monotonic() + FILL_SECONDS
    while len(jobs) < lanes and (left := deadline - time.monotonic()) > 0:
        job = store.next(left)
        if job is None:
            break
        jobs.append(job)
        jobs += store.take_more(lanes - len(jobs))
    return jobs


def _leader_round(world: Any, pipe: Any, store: JobStore, output_dir: Path, jobs: list[Job]) -> int:
    """Rank 0: one round of data-parallel jobs (job i on lane i); each saved or failed alone."""
    send_message(world, {"op": "round", "jobs": [{"id": j.id, "params": j.params} for j in jobs]})
    started = time.perf_counter()
    first = jobs[0]
    results, errors = run_round(world, pipe, [j.params for j in jobs], lambda step, total: store.set_progress(
        first, int(100 * step / total) if total else 0))
    first.cache_counts = cache_counts(pipe)  # rank 0 ran the first job (lane 0): its counts are that job's
    for job, result, error in zip(jobs, results, errors, strict=True):
        if error is None:
            try:
                _save(job, result, output_dir)
            except Exception as exc:  # noqa: BLE001 - a job's failure is its outcome
                error = _describe(exc)
        store.finish(job, error)
        if error is None:
            log.info("hsdp serve: %s completed in %.2f s (a round of %d)", job.id, time.perf_counter() - started,
                     len(jobs))
        else:
            log.warning("hsdp serve: %s failed: %s", job.id, error)
    return len(jobs)


def follower_loop(world: Any, pipe: Any) -> int:
    """Ranks other than 0: run each job rank 0 sends until it sends stop; jobs run."""
    ran = 0
    while True:
        message = recv_message(world)
        op = message["op"]
        if op == "idle":
            continue
        if op == "stop":
            return ran
        if op == "round":
            run_round(world, pipe, [j["params"] for j in message["jobs"]])
            ran += len(message["jobs"])
            continue
        if op != "job":
            raise RuntimeError(f"hsdp serve: unknown message {op!r} from rank 0")
        error: str | None = None
        try:
            execute(pipe, message["params"])
        except Exception as exc:  # noqa: BLE001 - the same failure rank 0 sees; agreed below
            error = _describe(exc)
        agree_outcome(world, error)
        ran += 1
