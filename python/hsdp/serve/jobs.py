"""Rank 0's jobs: the FIFO queue the job loop takes from and the store the routes read.

A job is accepted only while the server accepts (``submit`` raises :class:`Stopping`
otherwise), and every accepted job ends ``completed``, ``failed`` (with its error: one the
model raised on some rank, or "the server stopped" for a job still queued at shutdown) or
``cancelled`` (``DELETE`` while it ran, or the end of ``--shutdown-grace``). The store is
shared by the HTTP thread and the job loop, so every access takes its lock.

Nothing here knows HTTP: the engine (this store and :mod:`.worker`'s loops) runs jobs for any
front end; :mod:`.app` is one. With a :class:`~hsdp.serve.state.StateDir` every change is
written through to SQLite, so that a restart finds the jobs again; without one, finished jobs
expire ``ttl`` seconds after they ended (their files with them).
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .params import LISTED_PROMPT_CHARS

if TYPE_CHECKING:
    from .state import StateDir

__all__ = ["CANCELLED", "COMPLETED", "FAILED", "IN_PROGRESS", "QUEUED", "Conflict", "Job", "JobStore", "QueueFull",
           "Stopping"]

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
FINAL = (COMPLETED, FAILED, CANCELLED)


class Stopping(RuntimeError):
    """The server is shutting down and takes no new job."""


class QueueFull(RuntimeError):
    """As many jobs wait as the server takes (``--max-queue``)."""


class Conflict(RuntimeError):
    """The job cannot be changed that way now."""


@dataclass
class Job:
    id: str
    params: dict[str, Any]
    model: str
    created_at: float = field(default_factory=time.time)
    status: str = QUEUED
    progress: int = 0
    started_at: float | None = None
    completed_at: float | None = None
    error: str | None = None
    output: Path | None = None  # the video file (videos)
    images: list[str] | None = None  # base64 PNGs (images)
    cache_counts: dict[str, dict[str, int]] | None = None  # its step cache's forwards, per transformer
    inference_time_s: float | None = None  # the pipeline call and the write, on rank 0
    stage_durations: dict[str, float] | None = None  # encode, denoise, decode, write (seconds, rank 0)
    peak_memory_mb: dict[int, float] | None = None  # per rank of the job
    compile: dict[str, Any] | None = None  # --compile: the warm-up this job waited for (hsdp.serve.worker)
    steps: int = 0  # denoising steps run so far
    cancel: threading.Event = field(default_factory=threading.Event)  # asked to stop at the next step
    cancel_reason: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def public(self, listed: bool = False) -> dict[str, Any]:
        """The job as ``GET /v1/videos/{id}`` shows it (vllm-omni's and OpenAI's video object);
        ``listed``: as a listing shows it, the prompt cut to its start."""
        p = self.params
        prompt = p["prompt"]
        if listed and len(prompt) > LISTED_PROMPT_CHARS:
            prompt = prompt[:LISTED_PROMPT_CHARS] + f"... ({len(p['prompt'])} characters)"
        code = "cancelled" if self.status == CANCELLED else "generation_failed"
        out: dict[str, Any] = {
            "id": self.id,
            "object": "video" if p["kind"] == "video" else "image.generation",
            "model": self.model,
            "status": self.status,
            "progress": self.progress,
            "steps_done": self.steps,
            "created_at": int(self.created_at),
            "started_at": None if self.started_at is None else int(self.started_at),
            "completed_at": None if self.completed_at is None else int(self.completed_at),
            "prompt": prompt,
            "seed": p["seed"],
            "size": None if p.get("width") is None or p.get("height") is None else f"{p['width']}x{p['height']}",
            "num_inference_steps": p.get("num_inference_steps"),
            "error": None if self.error is None else {"code": code, "message": self.error},
        }
        if p["kind"] == "video":
            out["num_frames"] = p.get("num_frames")
            out["fps"] = p["fps"]
            out["seconds"] = None if p.get("num_frames") is None else f"{p['num_frames'] / p['fps']:.3g}"
            if p.get("frames_from_seconds"):
                out["frames_from_seconds"] = p["frames_from_seconds"]["note"]
        for name in ("negative_prompt", "guidance_scale", "guidance_scale_2", "boundary_ratio", "flow_shift"):
            if p.get(name) is not None:
                out[name] = p[name] if name != "negative_prompt" or not listed else p[name][:LISTED_PROMPT_CHARS]
        if p.get("defaulted"):  # the sizes the request left out: what the job ran with, and why
            out["defaulted"] = p["defaulted"]
        if self.started_at is not None and self.completed_at is not None:
            out["inference_seconds"] = round(self.completed_at - self.started_at, 3)
        if self.inference_time_s is not None:
            out["inference_time_s"] = self.inference_time_s
        if self.stage_durations is not None:
            out["stage_durations"] = self.stage_durations
        if self.peak_memory_mb:
            out["peak_memory_mb"] = max(self.peak_memory_mb.values())
            out["peak_memory_mb_per_rank"] = {str(r): v for r, v in sorted(self.peak_memory_mb.items())}
        if self.compile is not None:
            out["compile"] = self.compile
        if p.get("cache") is not None:  # the job's step cache and, once it ran on rank 0's lane, its counts
            out["cache"] = {"spec": p["cache"], "forwards": self.cache_counts}
        return out


class JobStore:
    """``ttl``: seconds a finished job stays (0: for ever); ``state``: write every change through
    to a state folder (and take its jobs back: :meth:`restore`)."""

    def __init__(self, model: str, max_queue: int = 256, ttl: float = 3600.0, state: StateDir | None = None) -> None:
        self.model = model
        self.max_queue = max_queue
        self.ttl = ttl
        self.state = state
        self._lock = threading.Condition()
        self._jobs: dict[str, Job] = {}
        self._queue: collections.deque[Job] = collections.deque()
        self._accepting = True
        self._running: list[Job] = []  # one per lane at most (data parallel: several)
        self._next_sweep = 0.0
        # Called (outside the lock) with each job that ends, and with each running job asked to
        # stop: the metrics, and the worker's channel to the ranks of other lanes.
        self.on_finish: list[Callable[[Job], None]] = []
        self.on_cancel: list[Callable[[Job], None]] = []
        self.on_step: list[Callable[[Job, float], None]] = []  # each denoising step's seconds (rank 0's lane)

    def _save(self, job: Job) -> None:
        if self.state is not None:
            self.state.save(job)

    # ------------------------------------------------------------------ the routes' side

    def submit(self, params: dict[str, Any]) -> Job:
        prefix = "video" if params["kind"] == "video" else "img"
        job = Job(f"{prefix}_{secrets.token_hex(12)}", params, self.model)
        self._sweep()
        with self._lock:
            if not self._accepting:
                raise Stopping("the server is shutting down and takes no new jobs")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} jobs are waiting already (--max-queue {self.max_queue}); "
                                "retry later")
            self._jobs[job.id] = job
            self._queue.append(job)
            self._save(job)
            self._lock.notify_all()
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def list(self, kind: str | None = None) -> list[Job]:
        self._sweep()
        with self._lock:
            return [j for j in self._jobs.values() if kind is None or j.params["kind"] == kind]

    def delete(self, job_id: str) -> tuple[Job | None, bool]:
        """Removes a queued or finished job (and its file): (job, True). A running one is asked
        to stop at its next step instead (it ends ``cancelled`` and stays listed): (job, False).
        (None, False): no such job."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None, False
            if job.status == IN_PROGRESS:
                running = job
            else:
                running = None
                if job.status == QUEUED:
                    self._queue.remove(job)
                    job.status, job.error, job.completed_at = CANCELLED, "deleted before it ran", time.time()
                    job.done.set()
                del self._jobs[job_id]
                if self.state is not None:
                    self.state.delete(job_id)
        if running is not None:
            self.cancel(running, "cancelled while it ran (DELETE)")
            return running, False
        if job.output is not None:
            job.output.unlink(missing_ok=True)
        return job, True

    def cancel(self, job: Job, reason: str) -> None:
        """Asks a running job to stop at its next step boundary (every rank of its lane agrees
        on which: :meth:`hsdp.serve.worker.JobRun.agree`)."""
        with self._lock:
            if job.status != IN_PROGRESS or job.cancel.is_set():
                return
            job.cancel_reason = reason
            job.cancel.set()
        for callback in self.on_cancel:
            callback(job)

    def cancel_running(self, reason: str) -> int:
        with self._lock:
            running = list(self._running)
        for job in running:
            self.cancel(job, reason)
        return len(running)

    def queue_length(self) -> int:
        with self._lock:
            return len(self._queue) + len(self._running)

    def waiting(self) -> int:
        with self._lock:
            return len(self._queue)

    @property
    def accepting(self) -> bool:
        with self._lock:
            return self._accepting

    def _sweep(self) -> None:
        """:meth:`expire`, at most once a second (the routes call it)."""
        now = time.time()
        if self.ttl > 0 and now >= self._next_sweep:
            self._next_sweep = now + 1.0
            self.expire()

    def expire(self) -> int:
        """Drops finished jobs older than the ttl, and their files; how many."""
        if self.ttl <= 0:
            return 0
        now = time.time()
        with self._lock:
            old = [j for j in self._jobs.values() if j.status in FINAL and j.completed_at is not None
                   and now - j.completed_at > self.ttl]
            for job in old:
                del self._jobs[job.id]
                if self.state is not None:
                    self.state.delete(job.id)
        for job in old:
            if job.output is not None:
                job.output.unlink(missing_ok=True)
        return len(old)

    # ------------------------------------------------------------------ the job loop's side

    def next(self, timeout: float) -> Job | None:
        """The oldest queued job, now in progress; None after ``timeout`` seconds without one,
        or at once when the server stops accepting."""
        with self._lock:
            if not self._queue and self._accepting:
                self._lock.wait(timeout)
            if not self._queue or not self._accepting:
                return None
            job = self._queue.popleft()
            job.status, job.started_at = IN_PROGRESS, time.time()
            self._running.append(job)
            self._save(job)
            return job

    def take_more(self, n: int) -> list[Job]:
        """Up to n more queued jobs at once, in arrival order, without waiting (the lanes of a
        data-parallel server take a job each)."""
        out = []
        while len(out) < n:
            job = self.next(0)
            if job is None:
                break
            out.append(job)
        return out

    def set_progress(self, job: Job, step: int, total: int) -> None:
        with self._lock:
            job.steps = step
            job.progress = max(job.progress, min(99, int(100 * step / total) if total else 0))

    def set_compile(self, job: Job, record: dict[str, Any]) -> None:
        """The job's compile field (a new dict each time: the routes read it without the lock)."""
        with self._lock:
            job.compile = dict(record)

    def update(self, job: Job, params: dict[str, Any]) -> None:
        """The job's parameters as it runs them (the sizes it left out, filled)."""
        with self._lock:
            job.params = params
            self._save(job)

    def finish(self, job: Job, error: str | None, cancelled: bool = False) -> None:
        with self._lock:
            job.completed_at = time.time()
            job.status = CANCELLED if cancelled else FAILED if error is not None else COMPLETED
            job.error = error
            if job.status == COMPLETED:
                job.progress = 100
            if job in self._running:
                self._running.remove(job)
            self._save(job)
        job.done.set()
        for callback in self.on_finish:
            callback(job)

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False
            self._lock.notify_all()

    def fail_queued(self, reason: str) -> int:
        """At shutdown: every job still queued ends failed with ``reason``; how many. With a
        state folder they stay queued there instead, for the next start (the count is 0)."""
        with self._lock:
            jobs = list(self._queue)
            self._queue.clear()
            if self.state is not None:
                return 0
            now = time.time()
            for job in jobs:
                job.status, job.error, job.completed_at = FAILED, reason, now
        for job in jobs:
            job.done.set()
            for callback in self.on_finish:
                callback(job)
        return len(jobs)

    # ------------------------------------------------------------------ a restart

    def restore(self) -> tuple[int, int, int]:
        """The state folder's jobs, back in the store: finished ones as they were, queued ones
        queued again in arrival order, and one that was running when the server died marked
        failed (not re-run: a job that brought the server down would do so at every start).
        Returns (finished, queued, marked failed)."""
        if self.state is None:
            return 0, 0, 0
        finished = queued = failed = 0
        with self._lock:
            for job in self.state.load(self.model):
                if job.status == IN_PROGRESS:
                    job.status, job.completed_at = FAILED, time.time()
                    job.error = ("the server stopped while this job ran; it is not run again (a job that ended the "
                                 "server would end it at every start): submit it again")
                    job.done.set()
                    self._save(job)
                    failed += 1
                elif job.status == QUEUED:
                    self._queue.append(job)
                    queued += 1
                else:
                    job.done.set()
                    finished += 1
                self._jobs[job.id] = job
            self._lock.notify_all()
        return finished, queued, failed
