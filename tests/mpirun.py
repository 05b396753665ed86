"""Starting real multi-rank jobs from tests: mpiexec with what this kind of machine needs."""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from hsdp.world.launch import JOB_DIR_PREFIX, job_base, plain_mpiexec_env

ROOT = Path(__file__).resolve().parent.parent

# The environment hsdp.launch gives ranks (root, oversubscription, no binding, idle yield,
# one BLAS thread per rank), for starting plain mpiexec with the same settings.
MPI_ENV = plain_mpiexec_env("openmpi", environ={})


def mpiexec() -> str:
    exe = shutil.which("mpiexec")
    if exe is None:
        pytest.fail("mpiexec is not installed; `make test` installs Open MPI (apt-get install openmpi-bin)")
    return exe


# What makes a worker run on the test-only fake-device backend (csrc/backend_fakedev.c: host
# memory that claims to be a device, over MPI): workers start their world with
# init_process_group(os.environ.get("HSDP_TEST_BACKEND", "auto")), and torch workers put
# their buffers on the device its device_info names (tests/torch_models.py, target_device).
FAKEDEV = {"HSDP_FAKE_DEVICE": "1", "HSDP_TEST_BACKEND": "fakedev"}


def run_ranks(n: int, *args: str, timeout: float = 300,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs `python ARGS...` on n ranks (with `env` added: FAKEDEV, say); fails the test with
    the output if any rank fails."""
    env = {**os.environ, **MPI_ENV, **(env or {})}
    cmd = [mpiexec(), "-n", str(n), sys.executable, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


@dataclass
class Watched:
    """A job run to its end by :func:`run_watched`."""

    pid: int  # of the process started (the launcher, or mpiexec)
    returncode: int
    output: str  # stdout and stderr, interleaved as written
    started: float  # time.monotonic() at launch
    ended: float  # when the job's process exited
    seen: dict[str, float]  # each watched text -> when it first appeared in the output

    def after(self, text: str) -> float:
        """Seconds from the first line holding ``text`` to the end of the job."""
        assert text in self.seen, f"{text!r} never appeared:\n{self.output}"
        return self.ended - self.seen[text]


def run_watched(cmd: list[str], env: dict[str, str], limit: float, watch: tuple[str, ...] = (),
                on_seen: Callable[[str, subprocess.Popen[str]], None] | None = None) -> Watched:
    """Runs ``cmd`` (in ROOT, a session of its own), noting when each text of ``watch`` first
    shows up in its output (``on_seen`` is called then). A job still running after ``limit``
    seconds is ended (SIGTERM, then SIGKILL to its session) and fails the test with its
    output: a job that should have ended itself fails in ``limit`` seconds, not at a
    generic subprocess timeout."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    seen: dict[str, float] = {}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.monotonic()
            lines.append(line)
            for text in watch:
                if text in line and text not in seen:
                    seen[text] = now
                    if on_seen is not None:
                        on_seen(text, proc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher (or mpiexec) ends its ranks
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
        pytest.fail(f"{' '.join(cmd)} still ran after {limit:.0f} s\n{''.join(lines)}")
    ended = time.monotonic()
    reader.join(timeout=10)
    return Watched(proc.pid, code, "".join(lines), t0, ended, seen)


def ready_ranks(output: str) -> dict[int, tuple[int, list[str]]]:
    """rank -> (pid, shared-memory segments mapped) from tests/timeout_worker.py's ready lines."""
    found = {}
    for m in re.finditer(r"rank (\d+): ready pid=(\d+) segments=([^;]*);", output):
        found[int(m.group(1))] = (int(m.group(2)), [p for p in m.group(3).split(",") if p])
    return found


def alive(pid: int) -> bool:
    """Whether pid still runs (a zombie has ended: it holds no memory and no files)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def assert_nothing_left(run: Watched, ranks: int = 2) -> None:
    """No rank of the job runs, none of the segments its ranks mapped exists, and the
    launcher's job directory is gone (hsdp.launch: /dev/shm/hsdp-launch.PID.*)."""
    launcher_pid = run.pid
    found = ready_ranks(run.output)
    assert sorted(found) == list(range(ranks)), run.output
    segments = {p for _, paths in found.values() for p in paths}
    assert segments, f"no rank reported a shared-memory segment:\n{run.output}"
    job_dirs = sorted(glob.glob(os.path.join(job_base(), f"{JOB_DIR_PREFIX}{launcher_pid}.*")))
    assert not job_dirs, f"left behind: {job_dirs}"
    for p in segments:  # Open MPI's, placed in the job's directory by the launcher
        assert f"/{JOB_DIR_PREFIX}{launcher_pid}." in p, f"segment outside the launcher's job directory: {p}"
        assert not os.path.exists(p), f"left behind: {p}"
    running = [pid for pid, _ in found.values() if alive(pid)]
    assert not running, f"ranks still running: {running}"
