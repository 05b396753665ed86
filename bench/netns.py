"""Two "hosts" on one machine: network namespaces joined by a veth pair, with Open MPI
starting the second rank inside the other namespace (and another UTS namespace, so it sees
another host name) through its rsh agent, over TCP only (no shared memory). Needs root and
`ip netns`; `unavailable()` says why not, for a skip.

Used by tests/test_netns.py, bench/bench_tcp.py and bench/bench_tcp_cpu.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

SUBNET = "10.77.{n}.0/24"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """None when two namespaces can be made here, else the reason."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    for tool in ("ip", "unshare", "mpiexec"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    probe = f"hsdp-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"ip netns add is not permitted here: {exc.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[list[str]]:
    """Yields the command prefix that runs `mpiexec ... -n 2 ...` with rank 0 in namespace A
    (10.77.n.1) and rank 1 in namespace B (10.77.n.2, host name hsdp-b), TCP only."""
    n = os.getpid() % 200 + 20
    a, b = f"hsdp-a-{os.getpid()}", f"hsdp-b-{os.getpid()}"
    va, vb = f"hva{os.getpid() % 100000}", f"hvb{os.getpid() % 100000}"
    ip_a, ip_b = f"10.77.{n}.1", f"10.77.{n}.2"
    tmp = Path(tempfile.mkdtemp(prefix="hsdp-netns-"))
    agent = tmp / "agent.sh"
    # Open MPI's rsh agent gets the host and the daemon's command line
    agent.write_text(
        "#!/bin/sh\nhost=\"$1\"; shift\n"
        f"if [ \"$host\" = \"{ip_b}\" ]; then exec ip netns exec {b} unshare --uts sh -c \"hostname hsdp-b; $*\"; fi\n"
        "exec sh -c \"$*\"\n"
    )
    agent.chmod(0o755)
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, ip_a), (b, vb, ip_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        subnet = SUBNET.format(n=n)
        yield ["ip", "netns", "exec", a, "mpiexec", "--mca", "plm_rsh_agent", str(agent), "--mca", "btl", "tcp,self",
               "--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet,
               "--host", f"{ip_a}:1,{ip_b}:1", "-n", "2", "-x", "PATH", "-x", "OMP_NUM_THREADS=1",
               "-x", "OPENBLAS_NUM_THREADS=1", "-x", "HSDP_TIMEOUT"]
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def run_on_two_hosts(argv: list[str], cwd: Path, what: str, timeout: float = 600) -> str:
    """Runs ``python argv...`` as 2 ranks in two namespaces (``two_hosts``) and returns their
    stdout; SystemExit naming ``what`` when namespaces are not available or a rank fails. A
    checkout run with PYTHONPATH (no install) passes it on to the ranks."""
    why = unavailable()
    if why:
        raise SystemExit(f"{what}: two network namespaces are not available here: {why}")
    from hsdp.world.launch import plain_mpiexec_env

    env = {**os.environ, **plain_mpiexec_env("openmpi")}  # the ranks as hsdp.launch starts them
    fwd = ["-x", "PYTHONPATH"] if os.environ.get("PYTHONPATH") else []
    with two_hosts() as prefix:
        proc = subprocess.run([*prefix, *fwd, "--wdir", str(cwd), sys.executable, *argv], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise SystemExit(proc.stdout + proc.stderr)
    return proc.stdout
