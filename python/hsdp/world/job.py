"""Who this process is in the job, as its launcher says: the one reading of the launcher's
variables (:func:`launch_info`). The backend picker (``distributed``), the NCCL bootstrap
(``nccl``) and the command line (``cli.ranks``) all ask it, so "launched by torchrun" and
"launched by MPI" mean one thing everywhere."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# Launcher variables that mean "this process is one rank of an MPI job".
MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK", "MPI_LOCALNRANKS")
# The variables that mean torchrun (or any launcher speaking its protocol) started this
# process; MASTER_PORT and LOCAL_RANK are then read and checked too.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


@dataclass(frozen=True)
class Launch:
    """Who this process is in the job, as its launcher says."""

    via: str  # "torchrun", "mpi" or "single"
    rank: int
    size: int
    local_rank: int
    master_addr: str | None = None
    master_port: int | None = None
    agent_store: bool = False
    restart: int = 0


def _int_var(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None:
        if default is None:
            raise ValueError(f"{name} is not set; torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def _mpi_local_rank(environ: Mapping[str, str]) -> int | None:
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PMIX_LOCAL_RANK"):
        if name in environ:
            return _int_var(environ, name)
    return None


def launched_by_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI launcher started this process (one of :data:`MPI_ENV` is set)."""
    env = os.environ if environ is None else environ
    return any(k in env for k in MPI_ENV)


def launch_info(environ: Mapping[str, str] | None = None) -> Launch:
    """This process's place in the job: an MPI launcher's variables first (an MPI job is
    MPI's even if torchrun-like variables are also set), then torchrun's, else a world of
    one. Bad or contradictory values are errors naming the variable."""
    env = os.environ if environ is None else environ
    if launched_by_mpi(env):
        # rank and size come from the MPI world itself when the id is exchanged
        local = _mpi_local_rank(env)
        return Launch("mpi", -1, -1, -1 if local is None else local)
    if all(k in env for k in TORCHRUN_ENV):
        rank, size = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
        local = _int_var(env, "LOCAL_RANK", rank)
        port = _int_var(env, "MASTER_PORT")
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"RANK={rank} is outside WORLD_SIZE={size}")
        if local < 0:
            raise ValueError(f"LOCAL_RANK must be >= 0, got {local}")
        if not 0 < port < 65536:
            raise ValueError(f"MASTER_PORT must be a TCP port (1-65535), got {port}")
        return Launch(
            "torchrun", rank, size, local, env["MASTER_ADDR"], port,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            restart=_int_var(env, "TORCHELASTIC_RESTART_COUNT", 0),
        )
    return Launch("single", 0, 1, _int_var(env, "LOCAL_RANK", 0))


# Rank variables in the order they are trusted before a world exists: an MPI launcher's,
# then torchrun's.
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK")
# Ranks on this host, as MPI launchers (Open MPI, MPICH/Hydra, PMI) and torchrun say it.
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "LOCAL_WORLD_SIZE")
# Prefixes of the variables that make a child process think it is a rank of this job.
_JOB_PREFIXES = ("OMPI_COMM_WORLD", "PMI_", "PMIX_")


def launcher_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank as its launcher set it, before any world is started (a whole load
    needs no collective, yet logs on rank 0 only); None when no launcher variable holds one."""
    env = os.environ if environ is None else environ
    for name in _RANK_VARS:
        text = env.get(name, "")
        if text.isdigit():
            return int(text)
    return None


def local_size(environ: Mapping[str, str] | None = None) -> int:
    """The ranks on this host as the launcher says (MPI or torchrun), else 1. A value that is
    not a positive integer is skipped: this is an estimate (ranks sharing the host's memory),
    never a check."""
    env = os.environ if environ is None else environ
    for name in _LOCAL_SIZE_VARS:
        text = env.get(name)
        if text and text.isdigit() and int(text) > 0:
            return int(text)
    return 1


def strip_launcher_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default ``os.environ``) without the MPI launcher's per-rank
    variables, for a process that starts a job of its own (``hsdp.launch``) from inside a
    rank: its children must not take them for their own place in a job."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if not k.startswith(_JOB_PREFIXES)}

