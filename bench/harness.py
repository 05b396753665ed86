"""Shared pieces of the benchmarks: launching ranks, timing, and markdown tables.

Every figure is a ratio of two paths measured side by side in the same run, interleaved
repetition by repetition, so the machine's drift hits both alike; absolute times on a
shared machine are noise, ratios are not.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from hsdp.world.launch import plain_mpiexec_env

ROOT = Path(__file__).resolve().parent.parent
# The environment hsdp.launch gives ranks (root, oversubscription, no binding, idle yield,
# one BLAS thread per rank), for starting plain mpiexec with the same settings.
MPI_ENV = plain_mpiexec_env("openmpi", environ={})


def launch(n: int, script: str, *args: str, timeout: float = 1800) -> str:
    """Runs `python script args` on n ranks and returns rank 0's lines (stdout)."""
    env = {**os.environ, **MPI_ENV}
    cmd = ["mpiexec", "-n", str(n), sys.executable, script, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def vm_kib(field: str = "VmHWM") -> int:
    """A /proc/self/status field in KiB: VmHWM is the peak resident set since the process
    started, VmRSS the current one."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak resident set (VmHWM) to the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def wait_quiet(below: float = 1.0, poll: float = 30, patience: float = 600) -> dict[str, object]:
    """Waits until the 1-minute load average is below `below` (polls every `poll` s, gives up
    after `patience` s); returns what it saw. A timed launch on a machine others use (a test
    suite, another bench) measures them too: the records keep these loads."""
    t0 = time.monotonic()
    while True:
        load = os.getloadavg()
        waited = time.monotonic() - t0
        if load[0] < below or waited >= patience:
            return {"load_before": [round(x, 2) for x in load], "waited_s": round(waited), "quiet": load[0] < below}
        print(f"  load average {load[0]:.2f} >= {below}: waiting ({waited:.0f} s so far)", file=sys.stderr, flush=True)
        time.sleep(poll)


def interleaved(fns: Sequence[Callable[[], object]], reps: int, sync: Callable[[], object] | None = None,
                stat: Callable[[list[float]], float] = statistics.median) -> list[float]:
    """Median (or `stat`) seconds of each fn, run in turn rep by rep (a barrier before each
    when given)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [stat(t) for t in times]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])])


def machine() -> str:
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    except OSError:
        pass
    return f"{os.cpu_count()} cores{mem}, {platform.processor() or platform.machine()}, Python {platform.python_version()}"
