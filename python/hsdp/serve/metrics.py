"""``GET /metrics``: the server's Prometheus metrics, kept by ``prometheus_client`` (a registry
of the server's own, not the process-global one, so that two servers in one process, as in
tests, keep apart). Fed by the job store's callbacks; the route renders the registry.

    hsdp_serve_queue_depth                  jobs waiting (not running)
    hsdp_serve_running_jobs                 jobs running
    hsdp_serve_jobs_total{status}           jobs ended: completed, failed, cancelled
    hsdp_serve_job_latency_seconds          a job's run, start to end (histogram)
    hsdp_serve_queue_wait_seconds           a job's wait, submitted to started (histogram)
    hsdp_serve_step_latency_seconds         a denoising step (rank 0's lane; histogram)
    hsdp_serve_peak_memory_mb{rank}         each rank's peak memory in the last job it ran
"""

from __future__ import annotations

from .jobs import FINAL, Job, JobStore

__all__ = ["ServeMetrics"]

_JOB_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServeMetrics:
    def __init__(self, store: JobStore, model: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model": model}
        Gauge("hsdp_serve_queue_depth", "Jobs waiting to run", registry=self.registry).set_function(store.waiting)
        Gauge("hsdp_serve_running_jobs", "Jobs running", registry=self.registry).set_function(
            lambda: store.queue_length() - store.waiting())
        self.jobs = Counter("hsdp_serve_jobs", "Jobs ended, by final status", ["status"], registry=self.registry)
        for status in FINAL:  # every status shows, at 0 until one ends so
            self.jobs.labels(status)
        self.job_latency = Histogram("hsdp_serve_job_latency_seconds", "A job's run, started to ended",
                                     buckets=_JOB_BUCKETS, registry=self.registry)
        self.queue_wait = Histogram("hsdp_serve_queue_wait_seconds", "A job's wait, submitted to started",
                                    buckets=_JOB_BUCKETS, registry=self.registry)
        self.step_latency = Histogram("hsdp_serve_step_latency_seconds", "One denoising step (rank 0's lane)",
                                      buckets=_STEP_BUCKETS, registry=self.registry)
        self.peak = Gauge("hsdp_serve_peak_memory_mb", "Each rank's peak memory in the last job it ran (MiB; "
                          "on CPU the process's peak resident set)", ["rank"], registry=self.registry)
        from prometheus_client import Info

        Info("hsdp_serve", "The served model", registry=self.registry).info(labels)
        store.on_finish.append(self.finished)
        store.on_step.append(self.stepped)

    def finished(self, job: Job) -> None:
        self.jobs.labels(job.status).inc()
        if job.started_at is not None and job.completed_at is not None:
            self.job_latency.observe(job.completed_at - job.started_at)
            self.queue_wait.observe(job.started_at - job.created_at)
        for rank, mb in (job.peak_memory_mb or {}).items():
            self.peak.labels(str(rank)).set(mb)

    def stepped(self, _job: Job, seconds: float) -> None:
        self.step_latency.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
