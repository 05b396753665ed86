"""A pytest plugin (entry point ``pytest11``: installed with hsdp, on in every pytest run):
``@pytest.mark.hsdp(ranks=N)`` runs a test function on N ranks, as one real MPI job.

    import pytest

    @pytest.mark.hsdp(ranks=2, timeout=120)
    def test_my_model_shards(hsdp_world):
        assert hsdp_world.size == 2
        ...                                  # every rank runs the body; collectives work

How it runs. In the pytest process the marked test is replaced by a job item of the same
name (:class:`RankJob`): it starts ``python -m hsdp.launch -n N --timeout T`` on
:mod:`hsdp.testing.pytest_rank`, and each rank runs pytest again on that one test (its
fixtures, conftest files and ini as usual: every rank sets up its own fixtures). Each rank
writes its outcome and traceback to a file of the job; the job item reports them under the
test's name, one section per rank that failed. A rank that fails ends the whole job
(:mod:`hsdp._rank`: its peers are not left waiting in a collective). A job still running at
``timeout`` seconds (the marker's, else the ini option ``hsdp_timeout``, 300) is ended by the
launcher, and the test fails saying so, with the ranks that had not finished and the job's
output. Without ``mpiexec`` or an hsdp built with MPI the test is skipped with the reason.

Fixtures: ``hsdp_world`` (the world group, started on first use) and ``hsdp_rank``.
See docs/testing.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["INNER_ENV", "RESULTS_ENV", "RankFailure", "RankJob"]

# Set in every rank's environment: this pytest is one rank of a marked test's job, so the
# marker runs the body here instead of starting another job.
INNER_ENV = "HSDP_PYTEST_RANKS"
# The folder each rank writes rank-<r>.json into.
RESULTS_ENV = "HSDP_PYTEST_RESULTS"
DEFAULT_TIMEOUT_S = 300.0
# Lines of the job's output shown when a rank left no result (crashed, killed, hung).
OUTPUT_TAIL_LINES = 60

_RUNNER = Path(__file__).with_name("pytest_rank.py")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("hsdp_timeout", help="seconds a @pytest.mark.hsdp test's job may run (default 300)",
                  default=str(DEFAULT_TIMEOUT_S))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "hsdp(ranks=N, timeout=SECONDS): run this test on N ranks as one MPI job (hsdp.launch); "
        "each rank's failure is reported under the test's name")


class RankFailure(Exception):
    """The job of a marked test failed; the message is the report."""


def _marker_args(item: pytest.Item) -> tuple[int, float]:
    marker = item.get_closest_marker("hsdp")
    assert marker is not None
    if marker.args:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.hsdp takes keywords: hsdp(ranks=N, timeout=S), "
                                f"got positional {marker.args!r}")
    unknown = set(marker.kwargs) - {"ranks", "timeout"}
    if unknown:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.hsdp got unknown keyword(s) {sorted(unknown)}; "
                                "it takes ranks= and timeout=")
    ranks = marker.kwargs.get("ranks")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.hsdp needs ranks=N, a positive int, got {ranks!r}")
    timeout = marker.kwargs.get("timeout", float(item.config.getini("hsdp_timeout")))
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.hsdp timeout= must be seconds > 0, got {timeout!r}")
    return ranks, float(timeout)


def _mpi_missing() -> str | None:
    """Why an MPI job cannot start here, or None."""
    if shutil.which("mpiexec") is None:
        return "mpiexec is not installed (Debian/Ubuntu: apt-get install openmpi-bin libopenmpi-dev)"
    from hsdp.world.distributed import backend_reason

    why = backend_reason("mpi")
    return None if why is None else f"hsdp's MPI backend is not usable: {why}"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Outside a job: each marked test becomes a :class:`RankJob` of the same name."""
    if os.environ.get(INNER_ENV):
        return
    for i, item in enumerate(items):
        if isinstance(item, pytest.Function) and item.get_closest_marker("hsdp") is not None:
            ranks, timeout = _marker_args(item)
            job = RankJob.from_parent(item.parent, name=item.name, target=item.nodeid, ranks=ranks,
                                      timeout=timeout, location_of=item)
            job.own_markers = list(item.own_markers)
            job.keywords.update(item.keywords)
            items[i] = job


class RankJob(pytest.Item):
    """A marked test run as an N-rank job; passes when every rank passed."""

    def __init__(self, *, target: str, ranks: int, timeout: float, location_of: pytest.Item, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target
        self.ranks = ranks
        self.timeout = timeout
        self._location = location_of.reportinfo()

    def reportinfo(self) -> tuple[Any, int | None, str]:
        path, line, _ = self._location
        return path, line, f"{self.name} [{self.ranks} ranks]"

    def runtest(self) -> None:
        missing = _mpi_missing()
        if missing is not None:
            pytest.skip(f"@pytest.mark.hsdp(ranks={self.ranks}): {missing}")
        results = Path(tempfile.mkdtemp(prefix="hsdp-pytest."))
        try:
            code, output = self._launch(results)
            self._judge(code, output, _read_results(results, self.ranks), _read_stacks(results, self.ranks))
        finally:
            shutil.rmtree(results, ignore_errors=True)

    def _launch(self, results: Path) -> tuple[int, str]:
        config = self.config
        root = config.rootpath
        from hsdp.world.job import strip_launcher_env

        env = strip_launcher_env()
        env[INNER_ENV] = str(self.ranks)
        env[RESULTS_ENV] = str(results)
        # the ranks import what this process imports (a src layout, conftest's sys.path edits)
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p and os.path.isdir(p)])
        args = [self.target, f"--rootdir={root}", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=",
                "-q", "--no-header", "-rN"]
        if config.inipath is not None:
            args += ["-c", str(config.inipath)]
        cmd = [sys.executable, "-m", "hsdp.launch", "-n", str(self.ranks), "--timeout", f"{self.timeout:g}",
               "--", str(_RUNNER), *args]
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", check=False)
        return proc.returncode, proc.stdout

    def _judge(self, code: int, output: str, results: dict[int, dict[str, Any]], stacks: dict[int, str]) -> None:
        from hsdp.world.launch import EXIT_TIMEOUT

        failed = {r: res for r, res in results.items() if res["outcome"] == "failed"}
        missing = [r for r in range(self.ranks) if not results.get(r, {}).get("done")]
        if failed:
            sections = [f"rank {r} failed ({res['when']}):\n{res['longrepr']}" for r, res in sorted(failed.items())]
            if missing:
                sections.append(f"ranks {missing} did not finish: the job ended them when rank {min(failed)} failed")
            raise RankFailure(f"{self.target} on {self.ranks} ranks: {len(failed)} of them failed\n\n"
                              + "\n\n".join(sections))
        if code == EXIT_TIMEOUT:
            raise RankFailure(f"{self.target} on {self.ranks} ranks: still running after the timeout of "
                              f"{self.timeout:g} s (@pytest.mark.hsdp(timeout=...)); the job was ended. Ranks that had "
                              f"not finished: {missing or 'none'}\n"
                              + "".join(f"--- where rank {r} was\n{stack}\n" for r, stack in sorted(stacks.items()))
                              + "--- the job's output (last lines)\n" + _tail(output))
        if missing or code != 0:
            raise RankFailure(f"{self.target} on {self.ranks} ranks: the job exited {code} and ranks {missing} did not "
                              f"finish the test (a crash, a kill, or a failure outside the test)\n--- the job's "
                              f"output (last lines)\n" + _tail(output))
        if results and all(res["outcome"] == "skipped" for res in results.values()):
            pytest.skip(results[0]["longrepr"] if 0 in results else "skipped on every rank")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:  # type: ignore[override]
        if isinstance(excinfo.value, RankFailure):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))


# Frames of pytest's and the launcher's own machinery, dropped from the stacks the ranks dump
# at a timeout: what is left is where the test was.
_MACHINERY = ("/_pytest/", "/pluggy/", "<frozen runpy>", "hsdp/world/_rank.py", "hsdp/testing/pytest_rank.py")


def _tail(output: str) -> str:
    lines = [line for line in output.rstrip("\n").splitlines() if not any(m in line for m in _MACHINERY)]
    return "\n".join(lines[-OUTPUT_TAIL_LINES:]) if lines else "(no output)"


def _read_stacks(folder: Path, ranks: int) -> dict[int, str]:
    """The stack each rank dumped when the timeout ended it (pytest's frames dropped)."""
    found = {}
    for r in range(ranks):
        try:
            text = (folder / f"rank-{r}.stack").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if text.strip():
            found[r] = _tail(text)
    return found


def _read_results(folder: Path, ranks: int) -> dict[int, dict[str, Any]]:
    found = {}
    for r in range(ranks):
        path = folder / f"rank-{r}.json"
        if path.is_file():
            try:
                found[r] = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue  # written half when the job ended it: as good as none
    return found


# ---------------------------------------------------------------- inside a rank: fixtures


@pytest.fixture
def hsdp_world() -> Iterator[Any]:
    """The world group of the job this test runs in (a world of one outside a job)."""
    from hsdp.world import distributed

    yield distributed.init_process_group()


@pytest.fixture
def hsdp_rank(hsdp_world: Any) -> int:
    """This rank's number in the job."""
    return int(hsdp_world.rank)
