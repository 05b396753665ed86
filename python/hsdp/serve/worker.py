"""The pipeline call every rank makes for each job, and the two loops around it: rank 0's
(take the next job, broadcast it, run it, record the outcome) and every other rank's (wait for
rank 0's next message, run the job it names, or stop). This is the engine: it knows the job
store, never HTTP (:mod:`.app` is one front end over it).

> **[Note: the step agreement]** At the end of every denoising step, the ranks running a job
> (the world; with data-parallel lanes, the job's lane) all-gather one small vote each: 0 go
> on, 1 stop (rank 0 was asked to cancel the job, or a rank of another lane heard so over
> :class:`LaneChannel`), 2 this rank failed (its step raised). Any vote above 0 stops the job
> on every one of its ranks at that same step boundary, so no rank is left waiting in a
> gather that its peers never enter: a cancel takes effect within one step, and a failure on
> one rank alone (``HSDP_SERVE_FAULT_PROMPT="PROMPT@1"``) fails the job everywhere, naming that rank
> (:func:`protocol.agree_outcome`: the failing rank's own error; with lanes, ``run_lanes``,
> which prefers it to the :class:`PeerFailed` of the ranks that stopped with it), and the
> ranks move on to the next job together. A failure inside a forward (between two gathers) is not covered:
> the peers then wait in the gather until ``HSDP_TIMEOUT`` ends the server, as before.
"""

from __future__ import annotations

import base64
import inspect
import io
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hsdp.pipelines.lanes import LanePeerFailed

from .jobs import Job, JobStore
from .params import Limits, fill_defaults
from .protocol import agree_outcome, recv_message, send_message

__all__ = ["FAULT_ENV", "LeaderSettings", "execute", "follower_loop", "heartbeat_seconds",
           "leader_loop", "pipeline_defaults"]

log = logging.getLogger("hsdp.serve")

# Fault injection for tests and drills: entries separated by "|", each PROMPT (a job with that
# prompt raises at the end of its first step on every rank) or PROMPT@RANK (on that rank alone).
FAULT_ENV = "HSDP_SERVE_FAULT_PROMPT"


def _faulty(prompt: str, rank: int) -> bool:
    for entry in filter(None, os.environ.get(FAULT_ENV, "").split("|")):
        text, _, where = entry.rpartition("@") if entry.rpartition("@")[2].isdigit() else (entry, "", "")
        if prompt == text and (not where or int(where) == rank):
            return True
    return False


class InjectedFault(RuntimeError):
    pass


class JobCancelled(RuntimeError):
    """The job's ranks agreed to stop it at this step boundary (a cancel)."""


class PeerFailed(LanePeerFailed):
    """Another rank of the job failed at this step: this rank stops with it (its error is that
    rank's, reported by the agreement on the outcome; with lanes, by run_lanes, which prefers
    a rank's own error to this one)."""


def heartbeat_seconds() -> float:
    """How often an idle rank 0 tells the others it is alive: well inside ``HSDP_TIMEOUT``, so
    that ranks waiting for the next job are not ended for waiting."""
    from hsdp.world import distributed

    timeout = distributed.get_timeout()
    return 5.0 if timeout <= 0 else max(0.05, min(5.0, timeout / 4))


# ----------------------------------------------------------------------------- one job on one rank


@dataclass
class JobRun:
    """One job on this rank: how its steps agree (``group``: its ranks; None: this rank alone),
    whether it was asked to stop, and when its stages began (rank 0 reports them)."""

    job_id: str
    group: Any = None
    cancelled: Callable[[], bool] = lambda: False
    on_step: Callable[[int, int, float], None] | None = None  # (step, total, seconds of that step)
    started: float = field(default_factory=time.perf_counter)
    first_forward: float | None = None
    last_step: float | None = None
    steps: int = 0
    step_seconds: list[float] = field(default_factory=list)  # each step's seconds, as on_step gets them

    def agree(self, step: int, failure: BaseException | None) -> None:
        """The step agreement (see the note above)."""
        vote = 2 if failure is not None else 1 if self.cancelled() else 0
        if self.group is None or self.group.size == 1:
            votes = [vote]
        else:
            out = np.empty(self.group.size, dtype=np.int64)
            self.group.all_gather(np.array([vote], dtype=np.int64), out)
            votes = [int(v) for v in out]
        if failure is not None:
            raise failure
        failed = [r for r, v in enumerate(votes) if v == 2]
        if failed:
            raise PeerFailed(f"rank {failed[0]} of this job's ranks failed at the end of step {step}")
        if any(v == 1 for v in votes):
            raise JobCancelled(f"at the end of step {step}")

    def stages(self, finished: float, written: float) -> dict[str, float]:
        first = self.first_forward if self.first_forward is not None else finished
        last = self.last_step if self.last_step is not None else first
        return {"encode": round(first - self.started, 4), "denoise": round(last - first, 4),
                "decode": round(finished - last, 4), "write": round(written - finished, 4)}


_current: dict[str, JobRun | None] = {"run": None}  # the job this rank's first transformer forward times


def _time_first_forward(pipe: Any) -> None:
    """A forward pre-hook on each transformer: the first forward of a job marks the end of its
    encode stage (prompt encoding, latents) and the start of its denoising."""
    def hook(_module: Any, _args: Any) -> None:
        run = _current["run"]
        if run is not None and run.first_forward is None:
            run.first_forward = time.perf_counter()

    for name in ("transformer", "transformer_2"):
        model = getattr(pipe, name, None)
        if model is not None and hasattr(model, "register_forward_pre_hook"):
            model.register_forward_pre_hook(hook)


def job_call(params: dict[str, Any], run: JobRun | None = None) -> dict[str, Any]:
    """The stock pipeline call of one job, its step-end callback holding the step agreement,
    the fault injection and the progress report."""
    import torch

    kwargs: dict[str, Any] = {
        "prompt": params["prompt"],
        "output_type": "np",
        "generator": torch.Generator("cpu").manual_seed(int(params["seed"])),
    }
    for name in ("negative_prompt", "width", "height", "num_frames", "num_inference_steps", "guidance_scale",
                 "guidance_scale_2", "true_cfg_scale"):
        if params.get(name) is not None:
            kwargs[name] = params[name]
    if params["kind"] == "image" and params.get("n", 1) > 1:
        kwargs["num_images_per_prompt"] = params["n"]
    if params.get("image_b64"):
        from PIL import Image

        kwargs["image"] = Image.open(io.BytesIO(base64.b64decode(params["image_b64"]))).convert("RGB")
    from hsdp.world import distributed

    faulty = _faulty(params["prompt"], distributed.get_rank() if distributed.is_initialized() else 0)
    run = run or JobRun("")

    def step_end(p: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        now = time.perf_counter()
        took = now - (run.last_step or run.first_forward or run.started)
        run.last_step, run.steps = now, step + 1
        run.step_seconds.append(took)
        failure: BaseException | None = None
        try:
            if faulty:
                raise InjectedFault(f"injected fault ({FAULT_ENV}) at the end of step {step}")
            if run.on_step is not None:
                run.on_step(step + 1, int(getattr(p, "_num_timesteps", 0) or params.get("num_inference_steps") or 0),
                            took)
        except Exception as exc:  # noqa: BLE001 - voted on below, then raised
            failure = exc
        run.agree(step, failure)
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
            steps = params.get("num_inference_steps")
            enable_cache(pipe, parse_cache(spec, num_inference_steps=steps, model=model_name))
        object.__setattr__(pipe, "_hsdp_serve_cache", key)
    if isinstance(state, PipelineState) and state.caches:
        for watch in state.caches.values():
            watch.counts.reset()


def cache_counts(pipe: Any) -> dict[str, dict[str, int]] | None:
    """This rank's counts for the job that just ran (None: no cache)."""
    from hsdp.pipelines.cache import cache_report

    return cache_report(pipe) if getattr(pipe, "_hsdp_serve_cache", (None, None))[0] is not None else None


class _JobOptions:
    """The per-job settings that are not call arguments: ``flow_shift`` (the scheduler's
    config: a scheduler made for the job) and ``boundary_ratio`` (Wan2.2's pipeline config),
    put back after the job."""

    def __init__(self, pipe: Any, params: dict[str, Any]) -> None:
        self.pipe, self.params = pipe, params
        self.scheduler: Any = None
        self.boundary: Any = None

    def __enter__(self) -> None:
        pipe, params = self.pipe, self.params
        if params.get("flow_shift") is not None:
            self.scheduler = pipe.scheduler
            pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, flow_shift=params["flow_shift"])
        if params.get("boundary_ratio") is not None:
            self.boundary = ("set", pipe.config.boundary_ratio)
            pipe.register_to_config(boundary_ratio=params["boundary_ratio"])

    def __exit__(self, *exc: object) -> None:
        if self.scheduler is not None:
            self.pipe.scheduler = self.scheduler
        if self.boundary is not None:
            self.pipe.register_to_config(boundary_ratio=self.boundary[1])


def execute(pipe: Any, params: dict[str, Any], run: JobRun | None = None) -> Any:
    """Run one job's pipeline call on this rank (every rank calls it with the same ``params``);
    rank 0's output, None elsewhere."""
    from hsdp.pipelines import generate

    use_cache(pipe, params)
    _current["run"] = run
    try:
        with _JobOptions(pipe, params):
            return generate(pipe, **job_call(params, run))
    finally:
        _current["run"] = None


def run_round(world: Any, pipe: Any, jobs: list[dict[str, Any]],
              runs: list[JobRun]) -> tuple[list[Any], list[str | None]]:
    """Data parallel: job i of the round runs on lane i, every lane at once, the lanes gathering
    in lockstep (hsdp.pipelines.lanes.run_lanes); a job that fails or is cancelled (at a step
    boundary: the step agreement within its lane) ends alone. Every rank calls it with the
    same jobs; returns each job's result (on rank 0) and error (on every rank)."""
    from hsdp.pipelines.lanes import lane_groups, run_lanes

    calls = [job_call(params, runs[i]) for i, params in enumerate(jobs)]
    options: list[_JobOptions] = []

    def before(i: int) -> None:
        use_cache(pipe, jobs[i])
        _current["run"] = runs[i]
        opts = _JobOptions(pipe, jobs[i])
        opts.__enter__()
        options.append(opts)

    try:
        return run_lanes(pipe, calls, world, lane_groups(pipe), before=before)
    finally:
        _current["run"] = None
        for opts in reversed(options):
            opts.__exit__()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def peak_memory_mb(reset: bool = False) -> float:
    """This rank's peak memory: the CUDA allocator's peak since the last reset on a GPU; on a
    CPU the process's peak resident set (a high-water mark since it started: it never falls)."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            value = torch.cuda.max_memory_allocated() / 2**20
            if reset:
                torch.cuda.reset_peak_memory_stats()
            return round(value, 1)
    except ImportError:
        pass
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


def _gather_peaks(world: Any) -> dict[int, float]:
    """Every rank's peak memory for the job that just ran (a collective over the world)."""
    out = np.empty(world.size, dtype=np.float64)
    world.all_gather(np.array([peak_memory_mb()], dtype=np.float64), out)
    peak_memory_mb(reset=True)
    return {r: float(v) for r, v in enumerate(out)}


def pipeline_defaults(pipe: Any) -> dict[str, Any]:
    """The sizes and step count the pipeline's call takes when a request leaves them out: its
    ``__call__``'s defaults (Wan: 832 x 480, 81 frames, 50 steps); a None size from the
    pipeline's default sample size (Flux: ``default_sample_size x vae_scale_factor``)."""
    out: dict[str, Any] = {}
    try:
        signature = inspect.signature(type(pipe).__call__)
    except (TypeError, ValueError):
        return out
    for name in ("width", "height", "num_frames", "num_inference_steps"):
        param = signature.parameters.get(name)
        if param is not None and isinstance(param.default, int) and not isinstance(param.default, bool):
            out[name] = param.default
    sample, factor = getattr(pipe, "default_sample_size", None), getattr(pipe, "vae_scale_factor", None)
    if isinstance(sample, int) and isinstance(factor, int):
        out.setdefault("width", sample * factor)
        out.setdefault("height", sample * factor)
    return out


def _save(job: Job, result: Any, output_dir: Path) -> None:
    """Rank 0: the job's video file, or its images as base64 PNGs."""
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


# ----------------------------------------------------------------------------- lanes: the cancel channel


class LaneChannel:
    """With data-parallel lanes, a cancel must reach ranks that share no group with rank 0 but
    the world, which is busy in the lanes' lockstep gathers. Rank 0 keeps a TCP listener; every
    other rank connects once at start, and rank 0 writes each cancelled job's id to every
    connection. A thread on each rank keeps the ids it has read; the step agreement of the
    job's lane then stops the job at the next step (any one of the lane's ranks that has read
    the id is enough)."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._server: socket.socket | None = None

    # rank 0
    def listen(self, world: Any) -> None:
        self._server = socket.create_server(("", 0))
        host = socket.gethostname()
        send_message(world, {"op": "channel", "host": host, "port": self._server.getsockname()[1]})
        for _ in range(world.size - 1):  # every other rank connects before its first job
            conn, _ = self._server.accept()
            self._conns.append(conn)

    def cancel(self, job_id: str) -> None:
        data = (job_id + "\n").encode()
        with self._lock:
            for conn in self._conns:
                try:
                    conn.sendall(data)
                except OSError:  # a rank gone: the launcher ends the job
                    pass

    # the other ranks
    def connect(self, message: dict[str, Any]) -> None:
        host = "127.0.0.1" if message["host"] == socket.gethostname() else message["host"]
        conn = socket.create_connection((host, int(message["port"])), timeout=60)
        conn.settimeout(None)
        threading.Thread(target=self._read, args=(conn,), name="hsdp-serve-cancels", daemon=True).start()
        self._conns.append(conn)

    def _read(self, conn: socket.socket) -> None:
        with conn.makefile("r", encoding="utf-8") as lines:
            for line in lines:
                with self._lock:
                    self.ids.add(line.strip())

    def heard(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self.ids

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        if self._server is not None:
            self._server.close()


def _lane_group(world: Any, pipe: Any) -> Any:
    """The ranks of this rank's lane, as a group (None: lanes of one rank). A collective over
    the world: every rank calls it at the same point."""
    from hsdp.pipelines.lanes import lane_groups

    groups = lane_groups(pipe)
    if groups is None or world.size // groups.dp_degree == 1:
        return None
    return world.split(color=groups.dp_rank, key=groups.lane_rank)


# ----------------------------------------------------------------------------- the loops


class CompileRecord:
    """Rank 0: the ``compile`` field of each job's record when the server compiles
    (``--compile``: :func:`hsdp.cli.compile_mode.compile_watch`). A compiled transformer's first
    forward is its compile, so the first job waits for it: while such a forward runs, the
    running jobs show ``compiling`` (the transformer) and ``compiling_since`` (seconds); at
    their end, ``warm_up`` (whether Dynamo compiled anything during the job: the first job, or
    a later one at sizes that compile again), ``compile_seconds`` (Dynamo's, on rank 0),
    ``compiled`` (the transformers whose first forward ran in the job, each with its seconds),
    ``first_step_seconds`` and ``later_step_seconds`` (the median of the others). The lanes of a
    data-parallel round compile at once and wait for each other, so every job of a round gets
    the round's record, measured on rank 0's lane."""

    def __init__(self, store: JobStore, watch: Any) -> None:
        self.store, self.watch = store, watch
        self.jobs: list[Job] = []
        self.before: float | None = None
        self.warmed: set[str] = set()
        watch.listeners.append(self._heard)

    def _base(self) -> dict[str, Any]:
        return {"mode": self.watch.mode, "transformers": list(self.watch.transformers)}

    def start(self, jobs: list[Job]) -> None:
        from hsdp.cli.compile_mode import compile_seconds

        self.jobs, self.before, self.warmed = list(jobs), compile_seconds(), set(self.watch.warmed)
        for job in jobs:
            self.store.set_compile(job, self._base())

    def _heard(self, name: str, started: bool) -> None:
        """A compiled transformer's first forward started or ended (in the job loop's thread)."""
        if started:
            record = {**self._base(), "compiling": name, "compiling_since": round(time.time(), 3)}
        else:
            record = self._base()
        for job in self.jobs:
            self.store.set_compile(job, record)

    def finish(self, jobs: list[Job], run: JobRun) -> None:
        from hsdp.cli.compile_mode import compile_seconds

        after = compile_seconds()
        # None before: nothing compiled yet in this process (Dynamo keeps no entry until then)
        spent = None if after is None else round(after - (self.before or 0.0), 3)
        compiled = {n: dict(v) for n, v in self.watch.warmed.items() if n not in self.warmed}
        later = sorted(run.step_seconds[1:])
        record = {**self._base(), "warm_up": bool(compiled) or bool(spent), "compile_seconds": spent,
                  "compiled": compiled,
                  "first_step_seconds": round(run.step_seconds[0], 4) if run.step_seconds else None,
                  "later_step_seconds": round(later[len(later) // 2], 4) if later else None}
        for job in jobs:
            self.store.set_compile(job, record)
        if record["warm_up"]:
            log.info("hsdp serve: %s waited for the compile warm-up (--compile %s): %s s compiling, first step "
                     "%s s, later steps %s s", ", ".join(j.id for j in jobs), self.watch.mode, spent,
                     record["first_step_seconds"], record["later_step_seconds"])
        self.jobs = []


@dataclass
class LeaderSettings:
    """What rank 0's loop needs besides the ranks and the pipeline: where videos go, the
    request limits and the folder (to fill a request's missing sizes)."""

    output_dir: Path
    limits: Limits = field(default_factory=Limits)
    folder: Any = None  # a PipelineFolder; None: sizes are left to the pipeline


def _start(store: JobStore, job: Job, settings: LeaderSettings, defaults: dict[str, Any]) -> None:
    if settings.folder is not None:
        store.update(job, fill_defaults(job.params, defaults, settings.limits, settings.folder))


def _leader_run(job: Job, store: JobStore, group: Any) -> JobRun:
    def on_step(step: int, total: int, took: float) -> None:
        store.set_progress(job, step, total)
        for callback in store.on_step:
            callback(job, took)

    return JobRun(job.id, group, job.cancel.is_set, on_step)


def _finish(store: JobStore, job: Job, error: str | None, note: str = "") -> None:
    # a lane's own error comes prefixed with its leader's rank ("rank 1: JobCancelled: ...")
    core = error.split(": ", 1)[1] if error is not None and error.startswith("rank ") else error
    cancelled = core is not None and core.startswith(JobCancelled.__name__)
    if cancelled:
        error = f"{job.cancel_reason or 'cancelled'}, {core.partition(': ')[2]}"
    store.finish(job, error, cancelled)
    if error is None:
        log.info("hsdp serve: %s completed in %.2f s%s", job.id, job.inference_time_s or 0.0, note)
    else:
        log.warning("hsdp serve: %s %s: %s", job.id, "cancelled" if cancelled else "failed", error)


def leader_loop(world: Any, pipe: Any, store: JobStore, settings: LeaderSettings | Path) -> int:
    """Rank 0: runs jobs until the store stops accepting, then fails what is still queued (or
    leaves it queued in a state folder) and tells the other ranks to stop. Returns the number
    of jobs run."""
    if isinstance(settings, Path):
        settings = LeaderSettings(settings)
    beat = heartbeat_seconds()
    ran = 0
    from hsdp.pipelines.lanes import lane_groups

    groups = lane_groups(pipe)
    defaults = pipeline_defaults(pipe)
    _time_first_forward(pipe)
    channel = None
    if groups is not None:
        channel = LaneChannel()
        channel.listen(world)
        store.on_cancel.append(lambda job: channel.cancel(job.id))
    lane = _lane_group(world, pipe)
    from hsdp.cli.compile_mode import compile_watch

    watch = compile_watch(pipe)
    record = CompileRecord(store, watch) if watch is not None else None
    try:
        while True:
            job = store.next(beat)
            if job is None:
                if not store.accepting:
                    break
                send_message(world, {"op": "idle"})  # keeps the waiting ranks inside HSDP_TIMEOUT
                continue
            if groups is not None:  # data parallel: up to one job per lane, all at once
                jobs = _fill_lanes(store, job, groups.dp_degree)
                for j in jobs:
                    _start(store, j, settings, defaults)
                ran += _leader_round(world, pipe, store, settings.output_dir, jobs, lane, record)
                continue
            _start(store, job, settings, defaults)
            if record is not None:
                record.start([job])
            send_message(world, {"op": "job", "id": job.id, "params": job.params})
            run = _leader_run(job, store, world)
            error: str | None = None
            result = None
            try:
                result = execute(pipe, job.params, run)
            except PeerFailed:
                pass  # the failing rank's own error comes with the agreement below
            except Exception as exc:  # noqa: BLE001 - a job's failure is its outcome, not the server's
                error = _describe(exc)
            finished = time.perf_counter()
            if error is None and result is not None:
                try:
                    _save(job, result, settings.output_dir)
                    job.cache_counts = cache_counts(pipe)
                except Exception as exc:  # noqa: BLE001 - its outcome
                    error = _describe(exc)
            written = time.perf_counter()
            error = agree_outcome(world, error)
            if error is None and result is None:
                error = "the job ended without an output on rank 0"
            job.peak_memory_mb = _gather_peaks(world)
            job.inference_time_s = round(written - run.started, 4)
            job.stage_durations = run.stages(finished, written)
            if record is not None:
                record.finish([job], run)
            _finish(store, job, error)
            ran += 1
    finally:
        if channel is not None:
            channel.close()
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


def _leader_round(world: Any, pipe: Any, store: JobStore, output_dir: Path, jobs: list[Job], lane: Any,
                  record: CompileRecord | None = None) -> int:
    """Rank 0: one round of data-parallel jobs (job i on lane i); each saved or failed alone."""
    send_message(world, {"op": "round", "jobs": [{"id": j.id, "params": j.params} for j in jobs]})
    # rank 0 hears its own lane's cancels from the job; the others' lanes, through the channel
    runs = [_leader_run(jobs[0], store, lane)] + [JobRun(j.id, lane, j.cancel.is_set) for j in jobs[1:]]
    if record is not None:
        record.start(jobs)
    results, errors = run_round(world, pipe, [j.params for j in jobs], runs)
    finished = time.perf_counter()
    if record is not None:
        record.finish(jobs, runs[0])
    jobs[0].cache_counts = cache_counts(pipe)  # rank 0 ran the first job (lane 0): its counts are that job's
    peaks = _gather_peaks(world)
    for i, (job, result, error) in enumerate(zip(jobs, results, errors, strict=True)):
        if error is not None and PeerFailed.__name__ in error.split(": ", 2)[:2]:  # no rank said why
            error = f"a rank of its lane failed: {error}"
        if error is None:
            try:
                _save(job, result, output_dir)
            except Exception as exc:  # noqa: BLE001 - a job's failure is its outcome
                error = _describe(exc)
        written = time.perf_counter()
        job.peak_memory_mb = peaks
        job.inference_time_s = round(written - runs[0].started, 4)
        if i == 0:
            job.stage_durations = runs[0].stages(finished, written)
        _finish(store, job, error, f" (a round of {len(jobs)})")
    return len(jobs)


def follower_loop(world: Any, pipe: Any) -> int:
    """Ranks other than 0: run each job rank 0 sends until it sends stop; jobs run."""
    ran = 0
    from hsdp.pipelines.lanes import lane_groups

    channel = None
    if lane_groups(pipe) is not None:
        channel = LaneChannel()
        message = recv_message(world)
        if message["op"] != "channel":
            raise RuntimeError(f"hsdp serve: rank 0 sent {message['op']!r} first, not the cancel channel")
        channel.connect(message)
    lane = _lane_group(world, pipe)
    _time_first_forward(pipe)

    def heard(job_id: str) -> Callable[[], bool]:
        return (lambda: channel.heard(job_id)) if channel is not None else (lambda: False)

    try:
        while True:
            message = recv_message(world)
            op = message["op"]
            if op == "idle":
                continue
            if op == "stop":
                return ran
            if op == "round":
                runs = [JobRun(j["id"], lane, heard(j["id"])) for j in message["jobs"]]
                run_round(world, pipe, [j["params"] for j in message["jobs"]], runs)
                _gather_peaks(world)
                ran += len(message["jobs"])
                continue
            if op != "job":
                raise RuntimeError(f"hsdp serve: unknown message {op!r} from rank 0")
            error: str | None = None
            try:
                execute(pipe, message["params"], JobRun(message["id"], world))
            except PeerFailed:
                pass
            except Exception as exc:  # noqa: BLE001 - the same failure rank 0 sees; agreed below
                error = _describe(exc)
            agree_outcome(world, error)
            _gather_peaks(world)
            ran += 1
    finally:
        if channel is not None:
            channel.close()
