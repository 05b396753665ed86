"""Ranks across hosts over TCP: two network namespaces joined by veth (root and `ip netns`;
skipped with the reason elsewhere), Open MPI with the TCP transport only. The ranks see
different hosts, so every gather is an MPI_Allgather over the link, and the sharded model
equals the unsharded one exactly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from mpirun import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import netns  # noqa: E402

WHY = netns.unavailable()


@pytest.mark.skipif(WHY is not None, reason=f"two network namespaces: {WHY}")
def test_two_hosts_over_tcp_shard_exactly():
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_mpi_yield_when_idle": "1", "HSDP_TIMEOUT": "60"}
    with netns.two_hosts() as prefix:
        proc = subprocess.run([*prefix, "--wdir", str(ROOT), sys.executable, "tests/netns_worker.py"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the two ranks' lines arrive through mpiexec and may be cut anywhere: find each object
    rows = sorted((json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1], proc.stdout
    assert rows[0]["host"] != rows[1]["host"] == "hsdp-b"
    assert all(r["exact"] and r["paths"] == ["collective"] for r in rows), rows
