"""Ranks across hosts over TCP: two network namespaces joined by veth (root and `ip netns`;
skipped with the reason elsewhere), Open MPI with the TCP transport only. The ranks see
different hosts, so every gather is an MPI_Allgather over the link, and the sharded model
equals the unsharded one exactly; and a stalled rank on the other host is named by the
watchdog, which asks it over TCP what it waits in."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from mpirun import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import netns  # noqa: E402
from mpirun import MPI_ENV  # noqa: E402

WHY = netns.unavailable()


@pytest.mark.skipif(WHY is not None, reason=f"two network namespaces: {WHY}")
def test_two_hosts_over_tcp_shard_exactly():
    env = {**os.environ, **MPI_ENV, "HSDP_TIMEOUT": "60"}
    with netns.two_hosts() as prefix:
        proc = subprocess.run([*prefix, "--wdir", str(ROOT), sys.executable, "tests/netns_worker.py"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the two ranks' lines arrive through mpiexec and may be cut anywhere: find each object
    rows = sorted((json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1], proc.stdout
    assert rows[0]["host"] != rows[1]["host"] == "hsdp-b"
    assert all(r["exact"] and r["paths"] == ["collective"] for r in rows), rows


@pytest.mark.skipif(WHY is not None, reason=f"two network namespaces: {WHY}")
def test_a_stalled_peer_on_another_host_is_named():
    """Rank 1 (on host hsdp-b) stalls before the first forward. Rank 0's watchdog cannot read
    it by pid; it asks it over TCP and names it, in no collective, instead of "unknown"."""
    env = {**os.environ, **MPI_ENV, "HSDP_TIMEOUT": "2"}
    with netns.two_hosts() as prefix:
        t0 = time.monotonic()
        proc = subprocess.run([*prefix, "--wdir", str(ROOT), sys.executable, "-m", "hsdp._rank",
                               "tests/timeout_worker.py", "forward"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        took = time.monotonic() - t0
    assert proc.returncode != 0
    line = next((l for l in proc.stderr.splitlines() if "has waited more than 2 s (HSDP_TIMEOUT)" in l), None)
    assert line is not None, proc.stderr
    assert "rank 0:" in line and "not in it: rank 1 (in no collective)" in line, line
    assert "unknown" not in line, line
    assert took < 2 + 10 + 10, took  # the timeout, plus start-up, plus the launcher's teardown
    print(f"job ended {took:.1f} s after launch")
