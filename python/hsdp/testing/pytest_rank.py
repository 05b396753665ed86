"""One rank of a ``@pytest.mark.hsdp`` test's job (:mod:`hsdp.testing.pytest_plugin`): runs
pytest on that one test (the arguments: its node id and the options) and writes this rank's
outcome to ``$HSDP_PYTEST_RESULTS/rank-<rank>.json`` as each phase ends, so that the outcome
survives the job ending this rank when another fails. Exits with pytest's status: a failing
rank ends the job (hsdp._rank)."""

import faulthandler
import json
import os
import signal
import sys

# hsdp._rank put this script's folder (inside the package) first on sys.path, as `python
# SCRIPT` does; its modules must not be importable as top-level names.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.getcwd()

import pytest

from hsdp.testing.pytest_plugin import RESULTS_ENV
from hsdp.world._rank import rank_label


class Recorder:
    """This rank's outcome: the first failure (setup, call or teardown) wins, else a skip,
    else passed; written after every phase."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.result: dict[str, str] | None = None

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.result, f)
        os.replace(tmp, self.path)  # whole or absent, even if the job ends this rank now

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.result is not None and self.result["outcome"] == "failed":
            pass  # the first failure stays the outcome
        elif report.failed:
            self.result = {"outcome": "failed", "when": report.when, "longrepr": report.longreprtext}
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.result = {"outcome": "skipped", "when": report.when, "longrepr": reason}
        elif self.result is None:
            self.result = {"outcome": "passed", "when": report.when, "longrepr": ""}
        self.result["done"] = report.when == "teardown"  # a rank that never gets here hung or was ended
        self._write()

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.result = {"outcome": "failed", "when": "collect", "longrepr": report.longreprtext}
            self._write()


_STACK = None  # kept open for faulthandler


def main() -> int:
    rank = rank_label().removeprefix("rank ")
    # the job's timeout ends the ranks with SIGTERM: each writes where it was to a file of its
    # own (then dies as before), which the plugin shows under the rank's number
    global _STACK
    _STACK = open(os.path.join(os.environ[RESULTS_ENV], f"rank-{rank}.stack"), "w")  # noqa: SIM115 - open until exit
    faulthandler.register(signal.SIGTERM, file=_STACK, all_threads=False, chain=True)
    recorder = Recorder(os.path.join(os.environ[RESULTS_ENV], f"rank-{rank}.json"))
    code = pytest.main(sys.argv[1:], plugins=[recorder])
    if recorder.result is None:  # nothing ran: the node id matched no test here
        recorder.result = {"outcome": "failed", "when": "collect",
                           "longrepr": f"pytest {' '.join(sys.argv[1:])} ran no test (exit status {int(code)})"}
        recorder._write()
        return 1
    return int(code)


sys.exit(main())
