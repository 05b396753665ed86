"""One rank of a job started by :mod:`hsdp.launch`: ``python -m hsdp._rank SCRIPT ARGS...``.

Runs SCRIPT as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``, as ``python SCRIPT ARGS``
would. What it adds is how a rank fails: an uncaught exception (or a non-zero ``sys.exit``)
prints its traceback with every line prefixed by the rank, then leaves with ``os._exit``,
without finalising MPI. A normal exit would run ``MPI_Finalize``, which waits for peers that
may be blocked in a collective for this rank forever; an abrupt non-zero exit instead makes
``mpiexec`` end the whole job, so a peer's failure becomes an error, not a hang.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Sequence

# Rank variables set by the launchers hsdp.distributed recognises (Open MPI, PMI, PMIx).
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")

_USAGE = "usage: python -m hsdp._rank SCRIPT [ARGS...]  (normally started by python -m hsdp.launch)"


def rank_label() -> str:
    """``rank N`` from the launcher's environment, or ``rank ?`` outside a launched job."""
    for var in _RANK_VARS:
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return f"rank {value}"
    return "rank ?"


def _die(lines: str, code: int) -> None:
    """Prints ``lines`` prefixed with the rank to stderr and exits at once, skipping atexit
    handlers (MPI_Finalize among them) so that mpiexec tears the job down."""
    prefix = f"[{rank_label()}] "
    # One write, so the traceback stays in one piece among the other ranks' output.
    text = "".join(prefix + line + "\n" for line in lines.rstrip("\n").splitlines())
    try:
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
    finally:
        os._exit(code)


def _exit_status(code: object) -> int:
    # sys.exit's conventions: None -> 0, an int as is, anything else is printed and means 1.
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1


def _format_exception(exc: BaseException) -> str:
    """The traceback as `python SCRIPT` prints it: the bootstrap's and runpy's frames dropped."""
    tb = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
        or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run_script(script: str, args: Sequence[str]) -> None:
    """Runs ``script`` as ``__main__``; returns only if it finishes with status 0."""
    sys.argv = [script, *args]
    # `python SCRIPT` puts the script's folder first on sys.path (for modules next to it);
    # `python -m hsdp._rank` put the working directory there instead.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        status = _exit_status(exc.code)
        if status != 0:
            # As `python SCRIPT` does: an int status is silent, anything else is printed.
            _die("" if isinstance(exc.code, int) else str(exc.code), status)
        raise
    except KeyboardInterrupt:
        _die("interrupted", 130)
    except BaseException as exc:  # noqa: BLE001 - every failure must end the job, not just Exception
        _die(_format_exception(exc), 1)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stderr)
        sys.exit(0 if argv else 2)
    run_script(argv[0], argv[1:])


if __name__ == "__main__":
    main()
