"""``--state-dir DIR``: the jobs in SQLite (the standard library's ``sqlite3``) and their videos
as files beside it, so that a restart loses no accepted job.

    DIR/jobs.sqlite   one row per job: its parameters, status, times, error and record (JSON)
    DIR/outputs/      the finished videos (ID.mp4)

Each change of a job is written (and committed) as it happens, under the job store's lock:
a server killed at any point leaves every job as its last change left it. What a restart does
with each is :meth:`hsdp.serve.jobs.JobStore.restore`'s. WAL journaling with
``synchronous=NORMAL``: a commit costs no fsync of the database file, and a power cut may lose
the last commits but never corrupts the database.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .jobs import Job

__all__ = ["StateDir"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    model TEXT NOT NULL,
    params TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    completed_at REAL,
    error TEXT,
    output TEXT,
    record TEXT NOT NULL
)
"""


class StateDir:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.outputs = self.path / "outputs"
        self.outputs.mkdir(parents=True, exist_ok=True)
        # One connection, used by the HTTP thread and the job loop: every use holds this lock.
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path / "jobs.sqlite", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        row = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM jobs").fetchone()
        self._seq = int(row[0])

    def save(self, job: Job) -> None:
        record = {"progress": job.progress, "images": job.images, "cache_counts": job.cache_counts,
                  "inference_time_s": job.inference_time_s, "stage_durations": job.stage_durations,
                  "peak_memory_mb": job.peak_memory_mb, "steps": job.steps, "compile": job.compile}
        output = None if job.output is None else str(job.output)
        with self._lock:
            self._seq += 1
            # seq keeps arrival order: a job keeps the seq of its first save
            self._db.execute(
                "INSERT INTO jobs (id, seq, model, params, status, created_at, started_at, completed_at, error, "
                "output, record) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                "params=excluded.params, status=excluded.status, started_at=excluded.started_at, "
                "completed_at=excluded.completed_at, error=excluded.error, output=excluded.output, "
                "record=excluded.record",
                (job.id, self._seq, job.model, json.dumps(job.params), job.status, job.created_at, job.started_at,
                 job.completed_at, job.error, output, json.dumps(record)))

    def delete(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def load(self, model: str) -> list[Job]:
        """Every job, in arrival order (the model they were served as is the current one)."""
        from .jobs import Job

        with self._lock:
            rows = self._db.execute(
                "SELECT id, params, status, created_at, started_at, completed_at, error, output, record FROM jobs "
                "ORDER BY seq").fetchall()
        jobs = []
        for jid, params, status, created, started, completed, error, output, record in rows:
            rec: dict[str, Any] = json.loads(record)
            job = Job(jid, json.loads(params), model, created_at=created, status=status, started_at=started,
                      completed_at=completed, error=error, output=None if output is None else Path(output))
            job.progress = int(rec.get("progress") or 0)
            job.images = rec.get("images")
            job.cache_counts = rec.get("cache_counts")
            job.inference_time_s = rec.get("inference_time_s")
            job.stage_durations = rec.get("stage_durations")
            peaks = rec.get("peak_memory_mb")
            job.peak_memory_mb = None if peaks is None else {int(r): float(v) for r, v in peaks.items()}
            job.steps = int(rec.get("steps") or 0)
            job.compile = rec.get("compile")
            jobs.append(job)
        return jobs

    def close(self) -> None:
        with self._lock:
            self._db.close()
