"""``python -m hsdp.launch -n N [--] SCRIPT ARGS...``: run a script on N MPI ranks.

A thin front for ``mpiexec`` that adds what a single machine (often a container, often run as
root, often with fewer cores than ranks) needs, so that the same one line works everywhere:

- Open MPI: ``OMPI_ALLOW_RUN_AS_ROOT[_CONFIRM]`` only when running as root, ``--oversubscribe``
  only when N exceeds the cores, idle ranks yield the CPU (``mpi_yield_when_idle``), the
  single-copy shared-memory path (CMA), which fails in many containers, is switched off, and
  ranks are not bound to one core each (``--bind-to none``, change with ``--bind-to``): Open
  MPI's default for small jobs pins a rank to a single core, which puts hsdp's collective
  worker thread on the same core as the compute and serialises what prefetch overlaps.
- Every implementation: one BLAS/OpenMP thread per rank (ranks already share the cores) and
  unbuffered Python output, unless the user set those variables.
- Variables the user already set are never overridden.

Each rank runs the script through :mod:`hsdp._rank`, which ends the whole job when one rank
fails instead of leaving the others waiting in a collective. The exit status of ``mpiexec``
is forwarded; SIGINT and SIGTERM are forwarded to it (``--timeout`` sends it SIGTERM).

However the job ends, the launcher leaves nothing behind: Open MPI's shared-memory segments
and session directory go to a directory of this job's own (``/dev/shm/hsdp-launch.PID.*``),
and at the end every process of the job still alive (found by a variable only its
processes carry) is killed and that directory removed. A rank killed mid-job does not
remove its segment itself (4 MB of ``/dev/shm`` each, until reboot).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Literal

__all__ = ["LaunchError", "SignalPolicy", "build_command", "detect_flavour", "end_job", "job_env", "launch_env", "main",
           "run_job"]

Flavour = Literal["openmpi", "mpich", "unknown"]

# Exit status when mpiexec cannot be found, as a shell reports a missing command.
EXIT_NO_MPIEXEC = 127
# Exit status when --timeout ended the job, as coreutils' timeout reports it.
EXIT_TIMEOUT = 124

# Carried by every process of a job (mpiexec passes its environment to local ranks): how the
# launcher finds ranks that outlive mpiexec. The value is the job's directory.
JOB_VAR = "HSDP_LAUNCH_JOB"
JOB_DIR_PREFIX = "hsdp-launch."
# After SIGTERM (forwarded, or --timeout's), how long mpiexec may take to end the ranks
# before it is killed; and how long killed processes may take to be gone.
GRACE_S = 10.0
REAP_S = 10.0

_INSTALL_HINT = (
    "install an MPI implementation that provides mpiexec (Debian/Ubuntu: "
    "`apt-get install openmpi-bin libopenmpi-dev`; `make build` does this when run as root), "
    "or pass --mpiexec PATH"
)

# Thread pools of the numerical libraries a rank may load. Each rank gets one thread: N ranks
# already compete for the cores, and N x cores threads only adds contention.
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int (number of ranks), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int (number of ranks), got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hsdp.launch",
        description="Run SCRIPT on N MPI ranks with mpiexec, with the environment a single "
        "machine or container needs. Everything after SCRIPT (or after --) goes to the script.",
        epilog="example: python -m hsdp.launch -n 4 -- examples/offline_inference/text_to_video.py "
        "--use-hsdp --hsdp-shard-size 4",
    )
    p.add_argument("-n", "--nproc", type=_positive_int, dest="nproc", metavar="N", help="number of ranks (required)")
    p.add_argument("--mpiexec", metavar="PATH", default=None, help="the mpiexec to use (default: the one on PATH)")
    p.add_argument(
        "--bind-to", default="none", metavar="WHAT",
        help="Open MPI process binding (default: none, so each rank's collective worker thread "
        "can run beside its compute; e.g. core, socket, numa)",
    )
    p.add_argument(
        "--timeout", type=_positive_seconds, default=None, metavar="SECONDS",
        help="end the job (SIGTERM to mpiexec, then SIGKILL) when it runs longer; exit status 124",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the environment and command that would run, and exit"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="SCRIPT ARGS", help="the script and its arguments")
    return p


def find_mpiexec(explicit: str | None) -> str | None:
    """The mpiexec to run: ``explicit`` if given (a path or a name on PATH), else PATH's."""
    return shutil.which(explicit or "mpiexec")


def detect_flavour(mpiexec: str) -> Flavour:
    """Which implementation ``mpiexec`` belongs to, from ``mpiexec --version``.

    Flags differ between implementations (MPICH's Hydra rejects ``--oversubscribe``), so only
    flags the detected one accepts are passed; "unknown" gets just the standard ``-n``.
    """
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "openrte" in text or "open-mpi" in text:
        return "openmpi"
    # MPICH, Intel MPI and MVAPICH all launch through Hydra.
    if "hydra" in text or "mpich" in text or "intel(r) mpi" in text:
        return "mpich"
    return "unknown"


def _core_count() -> int:
    """Cores this process may use, counted the way Open MPI counts slots (physical cores).

    Open MPI gives one slot per physical core by default, so on a machine with hyperthreads
    ``os.cpu_count()`` alone would let N ranks through that Open MPI then refuses.
    """
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    physical = set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            package = core = ""
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    package = value.strip()
                elif key == "core id":
                    core = value.strip()
                    physical.add((package, core))
    except OSError:
        pass
    return max(1, min(logical, len(physical)) if physical else logical)


def _running_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def launch_env(flavour: Flavour, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables to add to ``environ`` (only those not set there already)."""
    environ = dict(os.environ if environ is None else environ)
    wanted: dict[str, str] = {"PYTHONUNBUFFERED": "1"}  # rank output arrives while it runs
    wanted.update({var: "1" for var in _THREAD_VARS})
    if flavour == "openmpi":
        if _running_as_root():  # Open MPI refuses root without both
            wanted["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
            wanted["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        # Waiting ranks give the core away: with more ranks than cores, spinning starves peers.
        wanted["OMPI_MCA_mpi_yield_when_idle"] = "1"
        # CMA (process_vm_readv) is blocked by the default seccomp/ptrace rules of containers.
        wanted["OMPI_MCA_btl_vader_single_copy_mechanism"] = "none"
    return {k: v for k, v in wanted.items() if k not in environ}


def plain_mpiexec_env(flavour: Flavour = "openmpi", environ: dict[str, str] | None = None) -> dict[str, str]:
    """What to add to the environment to run plain ``mpiexec`` the way ``hsdp.launch`` does:
    :func:`launch_env`, plus the environment forms of the Open MPI flags the launcher passes
    (oversubscription allowed, no process binding). The tests and benchmarks use it."""
    added = launch_env(flavour, environ)
    if flavour == "openmpi":
        environ = dict(os.environ if environ is None else environ)
        for var, value in (("OMPI_MCA_rmaps_base_oversubscribe", "1"), ("OMPI_MCA_hwloc_base_binding_policy", "none")):
            if var not in environ:
                added[var] = value
    return added


def build_command(
    mpiexec: str,
    flavour: Flavour,
    nproc: int,
    command: Sequence[str],
    added_env: dict[str, str],
    cores: int,
    bind_to: str = "none",
) -> list[str]:
    """The mpiexec command line; each rank runs ``python -m hsdp._rank SCRIPT ARGS``."""
    cmd = [mpiexec, "-n", str(nproc)]
    if flavour == "openmpi":
        if nproc > cores:
            cmd.append("--oversubscribe")
        cmd += ["--bind-to", bind_to]
        # Open MPI forwards OMPI_* itself; -x also carries the rest to ranks on other hosts.
        for var in sorted(added_env):
            if not var.startswith("OMPI_"):
                cmd += ["-x", var]
    return cmd + [sys.executable, "-m", "hsdp._rank", *command]


def _error(message: str) -> None:
    print(f"hsdp.launch: error: {message}", file=sys.stderr, flush=True)


def _split_command(raw: list[str]) -> list[str]:
    # argparse.REMAINDER keeps the "--" separator; it belongs to the launcher, not the script.
    return raw[1:] if raw and raw[0] == "--" else raw


def job_base() -> str:
    """Where job directories go: /dev/shm (tmpfs, where Open MPI puts its segments by
    default) when it is a writable folder, else the temporary folder."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else tempfile.gettempdir()


def job_env(flavour: Flavour, job_dir: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that put the job's files in ``job_dir`` and mark its processes (only
    those not set in ``environ``; a user's own placement is kept, and not cleaned)."""
    environ = dict(os.environ if environ is None else environ)
    wanted = {JOB_VAR: job_dir}
    if flavour == "openmpi":
        # Shared-memory segments (btl vader; Open MPI 5 accepts the name for btl sm) and the
        # session directory (Open MPI 4's ORTE): both named by the job, both ours to remove.
        wanted["OMPI_MCA_btl_vader_backing_directory"] = job_dir
        wanted["OMPI_MCA_orte_tmpdir_base"] = job_dir
    return {k: v for k, v in wanted.items() if k not in environ}


def _job_pids(job_dir: str) -> list[int]:
    """Processes of this user whose environment marks them as the job's (Linux /proc)."""
    mark = f"{JOB_VAR}={job_dir}".encode()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or another user's
            continue
    return found


def _alive(pid: int) -> bool:
    """Whether pid still runs (a zombie has ended: it holds no memory and no files)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def end_job(job_dir: str) -> None:
    """Kills every process of the job still alive, waits until they are gone, then removes
    the job's directory. Safe to call more than once."""
    pids = _job_pids(job_dir)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + REAP_S
    left = [pid for pid in pids if _alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if _alive(pid)]
    if left:
        _error(f"processes {left} of the job did not end after SIGKILL; {job_dir} is left in place")
        return
    shutil.rmtree(job_dir, ignore_errors=True)


# A command's own answer to a signal while its job runs (hsdp serve: the first SIGTERM goes to
# rank 0 alone, which stops the server gracefully): called with the signal, mpiexec's process
# and how many signals came so far; True when it handled the signal, False for the default
# (forward it to mpiexec, which has GRACE_S to end the job before it is killed).
SignalPolicy = Callable[[int, "subprocess.Popen[bytes]", int], bool]


class LaunchError(RuntimeError):
    """The job could not be started (no mpiexec); ``status`` is the exit status to report."""

    def __init__(self, message: str, status: int = EXIT_NO_MPIEXEC) -> None:
        super().__init__(message)
        self.status = status


def _die_with_parent() -> None:
    """In mpiexec's process, before exec: SIGTERM when the launching process dies (Linux), so a
    killed launcher never leaves a job that runs in a session of its own behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run(cmd: list[str], env: dict[str, str], timeout: float | None = None, on_signal: SignalPolicy | None = None,
         new_session: bool = False) -> int:
    """Runs mpiexec, forwarding SIGINT/SIGTERM to it, and returns its exit status.

    A terminal's Ctrl-C reaches mpiexec directly as well (same process group); forwarding
    also covers a signal sent to the launcher alone (a scheduler, `kill`). After a signal
    (or ``timeout`` seconds, which sends SIGTERM) mpiexec has GRACE_S to end, then is killed.
    ``on_signal`` may answer a signal itself first; ``new_session`` starts mpiexec in a
    session of its own (a terminal's Ctrl-C then reaches this process alone), tied to this
    process's life.
    """
    proc = subprocess.Popen(cmd, env=env, start_new_session=new_session,
                            preexec_fn=_die_with_parent if new_session else None)
    received: list[int] = []
    kill_at: list[float] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        if on_signal is not None and on_signal(signum, proc, len(received)):
            return
        if not kill_at:
            kill_at.append(time.monotonic() + GRACE_S)
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    end_at = None if timeout is None else time.monotonic() + timeout
    timed_out = killed = False
    try:
        while True:
            now = time.monotonic()
            if end_at is not None and now >= end_at and not timed_out:
                timed_out = True
                _error(f"the job ran longer than --timeout {timeout:g} s; ending it")
                kill_at.append(now + GRACE_S)
                if proc.poll() is None:
                    proc.terminate()
            if kill_at and now >= kill_at[0] and not killed:
                killed = True
                if proc.poll() is None:
                    _error(f"mpiexec did not end {GRACE_S:g} s after SIGTERM; killing it")
                    proc.kill()
            wake = [t for t in (None if timed_out else end_at, None if killed or not kill_at else kill_at[0])
                    if t is not None]
            try:
                code = proc.wait(timeout=max(0.01, min(wake) - now) if wake else None)
                break
            except subprocess.TimeoutExpired:
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if timed_out:
        return EXIT_TIMEOUT
    if code < 0:  # mpiexec died of a signal: report it the way a shell does
        return 128 - code
    if code != 0 and received:  # Open MPI exits 1 when interrupted; say it was the signal
        return 128 + received[0]
    return code


def _locate(explicit: str | None) -> str:
    """find_mpiexec's answer, or LaunchError saying what is missing and how to install it."""
    found = find_mpiexec(explicit)
    if found is None:
        where = f"{explicit!r} is not an executable" if explicit else "mpiexec was not found on PATH"
        raise LaunchError(f"{where}; {_INSTALL_HINT}")
    return found


def run_job(nproc: int, command: Sequence[str], *, mpiexec: str | None = None, bind_to: str = "none",
            timeout: float | None = None, env: dict[str, str] | None = None, on_signal: SignalPolicy | None = None,
            new_session: bool = False) -> int:
    """Runs ``command`` (a script and its arguments) on ``nproc`` ranks, as ``python -m
    hsdp.launch`` does, and returns the job's exit status: the one way hsdp starts ranks
    (``hsdp generate``, ``hsdp serve``, the examples, hsdp.Omni and the pytest plugin through
    the launcher's command line). ``env`` is added to the ranks' environment; the job's
    processes and files are gone when it returns. LaunchError when mpiexec is missing."""
    found = _locate(mpiexec)
    flavour = detect_flavour(found)
    added = {**launch_env(flavour), **(env or {})}
    cmd = build_command(found, flavour, nproc, command, added, _core_count(), bind_to)
    job_dir = tempfile.mkdtemp(prefix=f"{JOB_DIR_PREFIX}{os.getpid()}.", dir=job_base())
    try:
        return _run(cmd, {**os.environ, **added, **job_env(flavour, job_dir)}, timeout, on_signal, new_session)
    finally:
        # mpiexec has ended; a second Ctrl-C must not stop the cleanup half-way (it is bounded).
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            end_job(job_dir)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m hsdp.launch`` and ``hsdp-launch``; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # argparse reports usage errors (and --help) by exiting
        return int(exc.code or 0)
    command = _split_command(args.command)
    if args.nproc is None:
        parser.print_usage(sys.stderr)
        _error("-n N (the number of ranks) is required")
        return 2
    if not command:
        parser.print_usage(sys.stderr)
        _error("no script given: python -m hsdp.launch -n N [--] SCRIPT ARGS...")
        return 2
    if not Path(command[0]).is_file():
        _error(f"script {command[0]!r} not found (working directory {os.getcwd()})")
        return 2

    try:
        if args.dry_run:
            _dry_run(_locate(args.mpiexec), args.nproc, command, args.bind_to)
            return 0
        return run_job(args.nproc, command, mpiexec=args.mpiexec, bind_to=args.bind_to, timeout=args.timeout)
    except LaunchError as exc:
        _error(str(exc))
        return exc.status


def _dry_run(mpiexec: str, nproc: int, command: list[str], bind_to: str) -> None:
    """Prints the environment and the command run_job would run."""
    flavour = detect_flavour(mpiexec)
    added = launch_env(flavour)
    print(f"# mpiexec implementation: {flavour}")
    for var, value in sorted(added.items()):
        print(f"export {var}={shlex.quote(value)}")
    placeholder = os.path.join(job_base(), f"{JOB_DIR_PREFIX}{os.getpid()}.XXXXXXXX")
    for var, value in sorted(job_env(flavour, placeholder).items()):
        print(f"# per job (the directory is removed at its end): export {var}={shlex.quote(value)}")
    print(shlex.join(build_command(mpiexec, flavour, nproc, command, added, _core_count(), bind_to)))

if __name__ == "__main__":
    sys.exit(main())
