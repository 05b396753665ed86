"""Starting a command's ranks: ``hsdp generate`` sized for N ranks and run from a plain shell
starts them itself through :mod:`hsdp.launch`; inside a job that a launcher already started
(``mpiexec``, ``hsdp.launch``, ``torchrun``) it runs as the rank it is."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["inside_launched_job", "launch_self"]

# The script each started rank runs (through hsdp._rank, as hsdp.launch runs any script).
_ENTRY = Path(__file__).with_name("rank_entry.py")


def inside_launched_job() -> bool:
    """Whether a launcher started this process as one rank of a job: the variables
    hsdp.distributed reads to pick its backend (MPI's, or torchrun's)."""
    from hsdp import distributed

    return distributed.launched_by_mpi() or distributed._launched_by_torchrun()


def launch_self(nproc: int, argv: Sequence[str]) -> int:
    """Runs ``python -m hsdp ARGV`` on ``nproc`` ranks through hsdp.launch; its exit status."""
    from hsdp import launch

    return launch.main(["-n", str(nproc), "--", str(_ENTRY), *argv])
