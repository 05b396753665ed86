"""Ranks that disagree on which unit they gather (issue: desync gave mixed weights silently):
every rank of the group raises, naming what each asked for, and none returns weights. The
check rides on every collective unit gather (the first of each unit; every one with
HSDP_DIRECT_GATHER=0); direct gathers need none, each rank reading its own unit's shards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mpirun import MPI_ENV, ROOT, mpiexec

WORKER = str(ROOT / "tests" / "agreement_worker.py")


def run(scenario: str, n: int = 2, **env: str) -> dict[int, list[str]]:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([mpiexec(), "-n", str(n), sys.executable, WORKER, scenario], cwd=ROOT,
                              env={**os.environ, **MPI_ENV, "HSDP_TIMEOUT": "60", "AGREEMENT_OUT": out, **env},
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return {r: Path(out, f"rank{r}.txt").read_text().splitlines() for r in range(n)
                if Path(out, f"rank{r}.txt").exists()}


# The tickets travel beside the data in groups of up to 8 ranks ("fused"); larger groups give
# them their own all-gather first, forced here with "separate".
MODES = [("fused", 2), ("fused", 3), ("separate", 2)]


def one_line_per_rank(scenario: str, mode: str, n: int) -> list[str]:
    """Each rank's one report line: every rank must have written exactly one."""
    got = run(scenario, n, AGREEMENT_MODE=mode)
    assert set(got) == set(range(n))
    assert all(len(got[r]) == 1 for r in range(n)), got
    return [got[r][0] for r in range(n)]


@pytest.mark.parametrize("mode,n", MODES)
def test_two_units_of_the_same_size_raise_on_every_rank(mode, n):
    for line in one_line_per_rank("equal", mode, n):
        assert line.startswith(f"RAISED the {n} ranks of a group do not gather the same unit, so none of them "
                               "gathers"), line
        assert "rank 0 asks for unit 'blocks.0'" in line and "rank 1 asks for unit 'blocks.1'" in line, line
        assert "rank 2 asks" not in line, line  # rank 2 asks what rank 0 asks: not repeated


@pytest.mark.parametrize("mode", ["fused", "separate"])
def test_the_same_unit_of_another_model_raises_on_every_rank(mode):
    """Identity only: blocks.0 of two models of one architecture (same name, same size, the
    same gather count on the group). Without the unit's identity in the ticket both ranks
    returned, each with the other model's shard in its weights."""
    lines = one_line_per_rank("twins", mode, 2)
    for line in lines:
        assert line.startswith("RAISED the 2 ranks of a group do not gather the same unit"), line
        idents = re.findall(r"asks for unit 'blocks\.0' \(the group's unit #(\d+) as made, \d+ bytes per rank, "
                            r"its gather #1 on this group\)", line)
        assert len(idents) == 2 and idents[0] != idents[1], line  # rank 0's and rank 1's, told apart


@pytest.mark.parametrize("mode,n", MODES)
def test_units_of_different_sizes_raise_on_every_rank_not_a_truncation(mode, n):
    for line in one_line_per_rank("unequal", mode, n):
        assert "do not gather the same unit" in line and "MPI_ERR_TRUNCATE" not in line, line
        sizes = [int(v) for v in re.findall(r"(\d+) bytes per rank", line)]
        assert len(sizes) == n and len(set(sizes)) == 2, line  # every rank unlike rank 0 is named


def test_ranks_that_disagree_on_the_float8_wire_raise_on_every_rank():
    for line in one_line_per_rank("wire", "fused", 2):
        assert "do not gather the same unit" in line and "asks for unit 'blocks.0'" in line, line
        sizes = [int(v) for v in re.findall(r"(\d+) bytes per rank", line)]
        assert len(sizes) == 2 and sizes[0] < sizes[1], line  # rank 0's float8 chunk is the smaller


@pytest.mark.parametrize("direct", ["1", "0"])
def test_a_caught_per_rank_exception_never_gives_wrong_numbers(direct):
    """Rank 1 raises inside request 2 (block 0 of 4) and goes on. With direct gathers the ranks stay
    independent and every request is exact; with collective gathers the ranks out of step
    raise (naming the units) until they meet again, and every request that returns is exact."""
    got = run("caught", HSDP_DIRECT_GATHER=direct)
    assert set(got) == {0, 1}
    for r, lines in got.items():
        assert not any("WRONG" in line for line in lines), lines
        assert all(line.endswith("EXACT") for line in lines[-3:]), lines  # they rejoin
    assert "request 2 RAISED ValueError: a per-request failure on this rank" in got[1]
    if direct == "1":
        assert len(got[0]) == 5 and all(line.endswith("EXACT") for line in got[0]), got[0]
    else:  # the ranks out of step each raised once, naming what each asked for
        for r in (0, 1):
            assert sum("RAISED RuntimeError: the 2 ranks of a group do not gather the same unit" in line
                       for line in got[r]) == 1, got[r]
