"""The pytest plugin (hsdp.testing.pytest_plugin, entry point pytest11) through pytester: a
sample user suite whose tests run on 2 ranks as real MPI jobs: one passing (an all-reduce
across the ranks), one failing on rank 1 only (the rank and the assertion reported under the
test's name), one hanging in a collective on rank 0 (ended at the marker's timeout), plus
bad marker arguments refused and the skip where MPI is missing."""

from __future__ import annotations

import os
import shutil

import pytest
from mpirun import MPI_ENV

pytest_plugins = ["pytester"]

SUITE = '''
import numpy as np
import pytest


@pytest.mark.hsdp(ranks=2)
def test_ranks_sum(hsdp_world, hsdp_rank):
    got = np.zeros(2, dtype=np.float32)
    hsdp_world.all_gather(np.array([hsdp_rank + 1], dtype=np.float32), got)
    assert hsdp_world.size == 2 and got.tolist() == [1.0, 2.0]


@pytest.mark.hsdp(ranks=2)
def test_rank_one_disagrees(hsdp_rank):
    answer = 41 + (hsdp_rank == 0)
    assert answer == 42, f"rank {hsdp_rank} computed {answer}"


@pytest.mark.hsdp(ranks=2, timeout=8)
def test_rank_zero_waits_forever(hsdp_world, hsdp_rank):
    if hsdp_rank == 0:
        hsdp_world.barrier()  # rank 1 never comes
    else:
        import time
        time.sleep(600)


def test_plain_stays_in_process():
    import os
    assert "HSDP_PYTEST_RANKS" not in os.environ
'''


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    for var, value in MPI_ENV.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("HSDP_TIMEOUT", "600")  # the hang must be ended by the test's timeout, not hsdp's
    pytester.makepyfile(test_user_model=SUITE)
    return pytester


def test_a_user_suite_on_two_ranks(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("-rA", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["PASSED test_user_model.py::test_ranks_sum", "PASSED*test_plain_stays_in_process"])
    # the failure: under the test's name, the failing rank, its assertion and traceback
    result.stdout.fnmatch_lines([
        "*_ test_rank_one_disagrees [[]2 ranks[]] _*",
        "*test_rank_one_disagrees on 2 ranks: 1 of them failed",
        "rank 1 failed (call):",
        "*assert answer == 42, f\"rank {hsdp_rank} computed {answer}\"",
        "E*AssertionError: rank 1 computed 41",
    ])
    assert "rank 0 failed" not in out
    # the hang: ended at the timeout, naming it and the ranks that had not finished
    result.stdout.fnmatch_lines([
        "*_ test_rank_zero_waits_forever [[]2 ranks[]] _*",
        ("*test_rank_zero_waits_forever on 2 ranks: still running after the timeout of 8 s*Ranks that had not "
        "finished: [[]0, 1[]]"),
    ])
    # where each rank was when the timeout ended it (faulthandler on SIGTERM)
    result.stdout.fnmatch_lines(["--- where rank 0 was", "Stack (most recent call first):",
                                 "*test_user_model.py\", line 21 in test_rank_zero_waits_forever"])


def test_bad_marker_arguments_are_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bad='''
import pytest

@pytest.mark.hsdp(ranks=0)
def test_none():
    pass
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*@pytest.mark.hsdp needs ranks=N, a positive int, got 0*"])


def test_skipped_with_the_reason_without_mpiexec(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    os.symlink(shutil.which("python3") or "/usr/bin/python3", bare / "python3")
    monkeypatch.setenv("PATH", str(bare))  # no mpiexec on PATH
    pytester.makepyfile(test_skip='''
import pytest

@pytest.mark.hsdp(ranks=2)
def test_two():
    pass
''')
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*@pytest.mark.hsdp(ranks=2): mpiexec is not installed*"])
