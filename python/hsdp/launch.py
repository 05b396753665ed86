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
is forwarded; SIGINT and SIGTERM are forwarded to it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Literal

__all__ = ["build_command", "detect_flavour", "launch_env", "main"]

Flavour = Literal["openmpi", "mpich", "unknown"]

# Exit status when mpiexec cannot be found, as a shell reports a missing command.
EXIT_NO_MPIEXEC = 127

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


def _run(cmd: list[str], env: dict[str, str]) -> int:
    """Runs mpiexec, forwarding SIGINT/SIGTERM to it, and returns its exit status.

    A terminal's Ctrl-C reaches mpiexec directly as well (same process group); forwarding
    also covers a signal sent to the launcher alone (a scheduler, `kill`).
    """
    proc = subprocess.Popen(cmd, env=env)
    received: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code < 0:  # mpiexec died of a signal: report it the way a shell does
        return 128 - code
    if code != 0 and received:  # Open MPI exits 1 when interrupted; say it was the signal
        return 128 + received[0]
    return code


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

    mpiexec = find_mpiexec(args.mpiexec)
    if mpiexec is None:
        where = f"{args.mpiexec!r} is not an executable" if args.mpiexec else "mpiexec was not found on PATH"
        _error(f"{where}; {_INSTALL_HINT}")
        return EXIT_NO_MPIEXEC

    flavour = detect_flavour(mpiexec)
    added = launch_env(flavour)
    cmd = build_command(mpiexec, flavour, args.nproc, command, added, _core_count(), args.bind_to)
    if args.dry_run:
        print(f"# mpiexec implementation: {flavour}")
        for var, value in sorted(added.items()):
            print(f"export {var}={shlex.quote(value)}")
        print(shlex.join(cmd))
        return 0
    return _run(cmd, {**os.environ, **added})


if __name__ == "__main__":
    sys.exit(main())
