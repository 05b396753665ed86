"""The specified API across real MPI ranks: every mesh shape of the issue, all scenarios.

Each launch runs every scenario of tests/mpi_worker.py on one (replicate, shard) mesh; the
worker asserts on every rank that the sharded model equals an unsharded one bit for bit.
"""

from __future__ import annotations

import re

import pytest

from mpirun import run_ranks

MESHES = [(1, 2), (1, 4), (2, 2), (4, 1), (2, 4), (1, 8)]


@pytest.mark.parametrize("replicate,shard", MESHES, ids=[f"{r}x{s}" for r, s in MESHES])
def test_mesh_all_scenarios(replicate: int, shard: int) -> None:
    proc = run_ranks(replicate * shard, "tests/mpi_worker.py", str(replicate))
    # Ranks share stdout, so their lines may run together: count ranks, not lines.
    done = set(re.findall(r"rank (\d+)/\d+ mesh \(\d+x\d+\): [\w ]+ OK", proc.stdout))
    assert done == {str(r) for r in range(replicate * shard)}, proc.stdout
