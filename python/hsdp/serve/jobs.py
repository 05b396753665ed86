"""Rank 0's jobs: the FIFO queue the job loop takes from and the store the routes read.

A job is accepted only while the server accepts (``submit`` raises :class:`Stopping`
otherwise), and every accepted job ends ``completed`` or ``failed``, with its error: one the
model raised, or "the server stopped" for a job still queued at shutdown. The store is shared
by the HTTP thread and the job loop, so every access takes its lock.
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Job", "JobStore", "Conflict", "QueueFull", "Stopping"]

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"


class Stopping(RuntimeError):
    """The server is shutting down and takes no new job."""


class QueueFull(RuntimeError):
    """As many jobs wait as the server takes (``--max-queue``)."""


class Conflict(RuntimeError):
    """The job is running: it cannot be deleted now."""


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
    done: threading.Event = field(default_factory=threading.Event)

    def public(self) -> dict[str, Any]:
        """The job as ``GET /v1/videos/{id}`` shows it (vllm-omni's and OpenAI's video object)."""
        p = self.params
        out: dict[str, Any] = {
            "id": self.id,
            "object": "video" if p["kind"] == "video" else "image.generation",
            "model": self.model,
            "status": self.status,
            "progress": self.progress,
            "created_at": int(self.created_at),
            "started_at": None if self.started_at is None else int(self.started_at),
            "completed_at": None if self.completed_at is None else int(self.completed_at),
            "prompt": p["prompt"],
            "seed": p["seed"],
            "size": None if p.get("width") is None or p.get("height") is None else f"{p['width']}x{p['height']}",
            "num_inference_steps": p.get("num_inference_steps"),
            "error": None if self.error is None else {"code": "generation_failed", "message": self.error},
        }
        if p["kind"] == "video":
            out["num_frames"] = p.get("num_frames")
            out["fps"] = p["fps"]
            out["seconds"] = None if p.get("num_frames") is None else f"{p['num_frames'] / p['fps']:.3g}"
        if self.started_at is not None and self.completed_at is not None:
            out["inference_seconds"] = round(self.completed_at - self.started_at, 3)
        if p.get("cache") is not None:  # the job's step cache and, once it ran on rank 0's lane, its counts
            out["cache"] = {"spec": p["cache"], "forwards": self.cache_counts}
        return out


class JobStore:
    def __init__(self, model: str, max_queue: int = 256) -> None:
        self.model = model
        self.max_queue = max_queue
        self._lock = threading.Condition()
        self._jobs: dict[str, Job] = {}
        self._queue: collections.deque[Job] = collections.deque()
        self._accepting = True
        self._running: list[Job] = []  # one per lane at most (data parallel: several)

    # ------------------------------------------------------------------ the routes' side

    def submit(self, params: dict[str, Any]) -> Job:
        prefix = "video" if params["kind"] == "video" else "img"
        job = Job(f"{prefix}_{secrets.token_hex(12)}", params, self.model)
        with self._lock:
            if not self._accepting:
                raise Stopping("the server is shutting down and takes no new jobs")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} jobs are waiting already (--max-queue {self.max_queue}); "
                                "retry later")
            self._jobs[job.id] = job
            self._queue.append(job)
            self._lock.notify_all()
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def list(self, kind: str | None = None) -> list[Job]:
        with self._lock:
            return [j for j in self._jobs.values() if kind is None or j.params["kind"] == kind]

    def delete(self, job_id: str) -> Job | None:
        """Removes a queued or finished job (and its file); Conflict while it runs."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            if job.status == IN_PROGRESS:
                raise Conflict(f"job {job_id} is running; delete it once it has ended")
            if job.status == QUEUED:
                self._queue.remove(job)
                job.status, job.error, job.completed_at = FAILED, "deleted before it ran", time.time()
                job.done.set()
            del self._jobs[job_id]
        if job.output is not None:
            job.output.unlink(missing_ok=True)
        return job

    def queue_length(self) -> int:
        with self._lock:
            return len(self._queue) + len(self._running)

    @property
    def accepting(self) -> bool:
        with self._lock:
            return self._accepting

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

    def set_progress(self, job: Job, progress: int) -> None:
        with self._lock:
            job.progress = max(job.progress, min(99, progress))

    def finish(self, job: Job, error: str | None) -> None:
        with self._lock:
            job.completed_at = time.time()
            job.status = FAILED if error is not None else COMPLETED
            job.error = error
            if error is None:
                job.progress = 100
            if job in self._running:
                self._running.remove(job)
        job.done.set()

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False
            self._lock.notify_all()

    def fail_queued(self, reason: str) -> int:
        """At shutdown: every job still queued ends failed with ``reason``; how many."""
        with self._lock:
            jobs = list(self._queue)
            self._queue.clear()
            now = time.time()
            for job in jobs:
                job.status, job.error, job.completed_at = FAILED, reason, now
        for job in jobs:
            job.done.set()
        return len(jobs)
