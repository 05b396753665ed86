"""Starting a command's ranks: ``hsdp generate`` or ``hsdp serve`` sized for N ranks and run
from a plain shell starts them itself through :func:`hsdp.world.launch.run_job` (what
``python -m hsdp.launch`` runs); inside a job that a launcher already started (``mpiexec``,
``hsdp.launch``, ``torchrun``) it runs as the rank it is. The example scripts start theirs the
same way (:func:`launch_script`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hsdp.world.launch import SignalPolicy

__all__ = ["inside_launched_job", "launch_script", "launch_self"]

# The script each started rank runs (through hsdp._rank, as hsdp.launch runs any script).
_ENTRY = Path(__file__).with_name("rank_entry.py")


def inside_launched_job() -> bool:
    """Whether a launcher started this process as one rank of a job: the variables
    hsdp.distributed reads to pick its backend (MPI's, or torchrun's): hsdp.world.job.launch_info."""
    from hsdp.world.job import launch_info

    return launch_info().via != "single"


def launch_self(nproc: int, argv: Sequence[str], *, env: dict[str, str] | None = None,
                on_signal: SignalPolicy | None = None, new_session: bool = False) -> int:
    """Runs ``python -m hsdp ARGV`` on ``nproc`` ranks (run_job; its keywords pass through);
    its exit status. LaunchError when mpiexec is missing."""
    from hsdp.world.launch import run_job

    return run_job(nproc, [str(_ENTRY), *argv], env=env, on_signal=on_signal, new_session=new_session)


def launch_script(config: object, script: str, argv: Sequence[str] | None, model: object = None) -> int | None:
    """What the example scripts call once their flags are checked, so that ``python SCRIPT
    ...`` from a plain shell starts its ranks as ``hsdp generate`` does: None where the script
    runs as it is (a world of one, or already a rank of a launched job); otherwise it runs
    SCRIPT with the same arguments on the config's world size through hsdp.launch (``--model``
    pinned to ``model``, the snapshot a hub id resolved to here: hsdp.hub) and returns the
    job's exit status."""
    size = int(config.world_size)  # type: ignore[attr-defined]
    if size == 1 or inside_launched_job():
        return None
    args_list = list(sys.argv[1:] if argv is None else argv)
    if model is not None:
        from hsdp.hub import pin_model_argv

        args_list = pin_model_argv(args_list, str(model))
    sys.stderr.write(f"{Path(script).name}: starting {size} ranks ({config.describe()}) with hsdp.launch\n")  # type: ignore[attr-defined]
    sys.stderr.flush()
    from hsdp.world.launch import LaunchError, run_job

    try:
        return run_job(size, [str(script), *args_list])
    except LaunchError as exc:
        sys.stderr.write(f"{Path(script).name}: error: {exc}\n")
        return exc.status
