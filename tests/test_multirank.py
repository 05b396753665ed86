"""The specified API across real MPI ranks: every mesh shape of the issue, all scenarios.

Each launch runs every scenario of tests/mpi_worker.py on every (replicate, shard) mesh of
its world size in turn (one launch per world size: a launch per mesh would cost its start);
the worker asserts on every rank that the sharded model equals an unsharded one bit for bit.
"""

from __future__ import annotations

import re

import pytest

from mpirun import FAKEDEV, run_ranks

# every mesh shape of the issue, grouped by world size
MESHES = {2: [(1, 2)], 4: [(1, 4), (2, 2), (4, 1)], 8: [(2, 4), (1, 8)]}


@pytest.mark.parametrize("n", list(MESHES), ids=["+".join(f"{r}x{s}" for r, s in m) for m in MESHES.values()])
def test_mesh_all_scenarios(n: int) -> None:
    proc = run_ranks(n, "tests/mpi_worker.py", ",".join(str(r) for r, _ in MESHES[n]))
    for r, s in MESHES[n]:
        assert r * s == n
        # Ranks share stdout, so their lines may run together: count ranks, not lines.
        done = set(re.findall(rf"rank (\d+)/{n} mesh \({r}x{s}\): [\w ]+ OK", proc.stdout))
        assert done == {str(k) for k in range(n)}, (r, s, proc.stdout)


def test_fake_device_backend_runs_the_core_scenarios() -> None:
    """A backend is one file plus a registry line: the test-only fakedev (a device table over
    MPI's collectives, csrc/backend_fakedev.c) runs representative scenarios on a 2x2 mesh
    with the same parity asserts as MPI (NumPy's buffers stay host memory: its views need it)."""
    scenarios = ["float32", "bfloat16", "replicas", "prefetch", "async_unshard", "resident_budget"]
    proc = run_ranks(4, "tests/mpi_worker.py", "2", *scenarios, env=FAKEDEV)
    done = set(re.findall(r"rank (\d+)/4 mesh \(2x2\): [\w ]+ OK on fakedev", proc.stdout))
    assert done == {"0", "1", "2", "3"}, proc.stdout


def test_failing_rank_ends_job_under_plain_mpiexec() -> None:
    """A peer that dies ends the job with an error in bounded time (docs/design.md, "Starting
    and stopping MPI"). The failing rank skips MPI_Finalize at exit, so mpiexec terminates
    the waiting one."""
    import os
    import subprocess
    import sys

    from mpirun import MPI_ENV, ROOT, mpiexec

    cmd = [mpiexec(), "-n", "2", sys.executable, "tests/mpi_fail.py", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **MPI_ENV}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in proc.stderr
    assert "passed a barrier" not in proc.stdout


def test_trace_file_per_rank(tmp_path) -> None:
    """HSDP_TRACE=DIR writes one Chrome trace per rank at exit, named and tagged by rank."""
    import json
    import os
    import subprocess
    import sys

    from mpirun import MPI_ENV, ROOT, mpiexec

    env = {**os.environ, **MPI_ENV, "HSDP_TRACE": str(tmp_path)}
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "tests/mpi_trace.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hsdp-trace-rank0.json", "hsdp-trace-rank1.json"]
    for rank in (0, 1):
        events = json.loads((tmp_path / f"hsdp-trace-rank{rank}.json").read_text())["traceEvents"]
        assert {e["pid"] for e in events} == {rank}
        assert any(e["name"].startswith("gather blocks.") and e["tid"] == 1 for e in events)
