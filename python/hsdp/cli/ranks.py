"""Starting a command's ranks: ``hsdp generate`` sized for N ranks and run from a plain shell
starts them itself through :mod:`hsdp.launch`; inside a job that a launcher already started
(``mpiexec``, ``hsdp.launch``, ``torchrun``) it runs as the rank it is."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["command_main", "inside_launched_job", "launch_script", "launch_self", "usage_error"]

# The script each started rank runs (through hsdp._rank, as hsdp.launch runs any script).
_ENTRY = Path(__file__).with_name("rank_entry.py")


def inside_launched_job() -> bool:
    """Whether a launcher started this process as one rank of a job: the variables
    hsdp.distributed reads to pick its backend (MPI's, or torchrun's): hsdp.world.job.launch_info."""
    from hsdp.world.job import launch_info

    return launch_info().via != "single"


def launch_self(nproc: int, argv: Sequence[str]) -> int:
    """Runs ``python -m hsdp ARGV`` on ``nproc`` ranks through hsdp.launch; its exit status."""
    from hsdp.world import launch

    return launch.main(["-n", str(nproc), "--", str(_ENTRY), *argv])


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
    from hsdp.world import launch

    return launch.main(["-n", str(size), "--", str(script), *args_list])


def usage_error(prog: str, message: str, status: int = 2) -> int:
    """Says a usage error on stderr, prefixed with this rank's label inside a job: every rank
    reaches the same verdict from the same flags and each says it, so a rank whose view
    differs (a folder missing on one host) does not fail silently. Returns `status`."""
    from hsdp.world._rank import rank_label

    label = rank_label()
    prefix = "" if label == "rank ?" else f"[{label}] "
    sys.stderr.write(f"{prefix}{prog}: error: {message}\n")
    sys.stderr.flush()
    return status


def command_main(prog: str, argv: Sequence[str] | None, parser: object, check: Callable[[object], tuple],
                 run: Callable[..., int], launch: Callable[[int, list[str]], int], usage: type[Exception],
                 how: str) -> int:
    """One command's entry: parse (argparse's usage errors exit 2, --help 0), check the
    flags (`usage` errors exit 2 on every rank), then either start the world size's ranks
    (`launch(n, argv)`, from a plain shell) or run as the rank this is (`run(args, *checked)`)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(args_list)  # type: ignore[attr-defined]
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        checked = check(args)
    except usage as exc:
        return usage_error(prog, str(exc))
    config = checked[-1]
    if config.world_size > 1 and not inside_launched_job():
        if getattr(args, "model", None) is not None:  # the ranks load the snapshot resolved here (hsdp.hub)
            from hsdp.hub import pin_model_argv

            args_list = pin_model_argv(args_list, args.model, getattr(args, "served_model_name", None))
        sys.stderr.write(f"{prog}: starting {config.world_size} ranks ({config.describe()}) {how}\n")
        sys.stderr.flush()
        return launch(config.world_size, args_list)
    return run(args, *checked)
