"""Rules decided once in ``hsdp.world`` (issue 37): the launcher's variables read only by
``world/job.py``; the backend a device needs chosen by ``world_for`` wherever a device is known,
so a GPU target under ``mpiexec`` starts NCCL instead of starting MPI and then refusing it
(checked against the fake CUDA/NCCL library, on one rank); and no import cycle between the
folders of ``python/hsdp``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import import_cycles
import pytest

from hsdp import _C
from hsdp.world import job
from mpirun import MPI_ENV, mpiexec

ROOT = Path(__file__).resolve().parent.parent


def test_launcher_rank_local_size_and_strip():
    """The three readings other folders ask of world/job.py, on given environments."""
    assert job.launcher_rank({}) is None
    assert job.launcher_rank({"PMI_RANK": "2", "RANK": "5"}) == 2  # an MPI launcher's first
    assert job.launcher_rank({"RANK": "3"}) == 3
    assert job.launcher_rank({"OMPI_COMM_WORLD_RANK": "x", "RANK": "1"}) == 1  # not a number: skipped
    assert job.local_size({}) == 1
    assert job.local_size({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == 4
    assert job.local_size({"LOCAL_WORLD_SIZE": "0", "MPI_LOCALNRANKS": "3"}) == 3
    env = {"OMPI_COMM_WORLD_RANK": "0", "PMI_SIZE": "2", "PMIX_RANK": "1", "PATH": "/bin", "OMPI_MCA_x": "1"}
    assert job.strip_launcher_env(env) == {"PATH": "/bin", "OMPI_MCA_x": "1"}  # MCA settings stay


def test_launcher_variables_are_read_only_in_world():
    """The issue's grep: launcher variables appear in python/ only under python/hsdp/world/."""
    out = subprocess.run(["git", "grep", "-nE", 'OMPI_|PMI_|PMIX_|LOCAL_WORLD_SIZE|"WORLD_SIZE"', "--", "python/"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode in (0, 1), out.stderr
    outside = [line for line in out.stdout.splitlines() if not line.startswith("python/hsdp/world/")]
    assert not outside, "launcher variables read outside python/hsdp/world/:\n" + "\n".join(outside)


def test_no_import_cycle_between_folders():
    """Folder-level imports of python/hsdp (module scope and lazy ones alike) form no cycle."""
    cycles = import_cycles.folder_cycles(ROOT / "python" / "hsdp")
    assert not cycles, "import cycles between folders of python/hsdp:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_one(tmp_path: Path):
    """The checker itself: two folders importing each other, lazily on one side, are a cycle."""
    pkg = tmp_path / "pkg"
    for name, text in {"a/__init__.py": "from ..b import x\n",
                       "b/__init__.py": "def f():\n    from pkg.a import y\n",
                       "c/__init__.py": "from ..a import z\n"}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    assert import_cycles.folder_cycles(pkg) == [["a", "b", "a"]]


_LOAD_CUDA = r"""
import sys
import hsdp
from hsdp.world import distributed
if sys.argv[1] == "load":
    import torch
    try:
        hsdp.load_model_sharded(torch.nn.Linear(4, 4), "/nonexistent/model.safetensors",
                                hsdp.HSDPInferenceConfig(enabled=True), target_device="cuda")
    except Exception as exc:
        print("ERR", type(exc).__name__, exc)
else:  # what hsdp serve and hsdp generate start their ranks' world with, for --device cuda
    distributed.world_for_device("cuda", "--device cuda")
print("WORLD", distributed.get_world_group().backend if distributed.is_initialized() else None, flush=True)
"""


def _fake_library() -> Path:
    built = subprocess.run(["make", "-s", "csrc/tests/bin/fake_cuda_nccl.so"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    return ROOT / "csrc" / "tests" / "bin" / "fake_cuda_nccl.so"


def test_load_model_sharded_to_cuda_under_mpiexec_starts_nccl():
    """load_model_sharded(target_device='cuda') in a rank mpiexec started: the world is NCCL's
    (bootstrapped over MPI), not MPI's refused later ("needs the NCCL process group, but this
    one runs on 'mpi'"). The checkpoint does not exist: the load fails after the world started."""
    proc = _under_mpiexec_with_the_fake("load")
    assert "runs on 'mpi'" not in proc.stdout, proc.stdout
    assert "/nonexistent/model.safetensors" in proc.stdout, proc.stdout  # the failure is the checkpoint's
    assert "WORLD nccl" in proc.stdout, proc.stdout


def test_a_cuda_device_flag_under_mpiexec_starts_nccl():
    """`hsdp serve --device cuda` (and `hsdp generate`) started without torchrun run their ranks
    under mpiexec: their world (distributed.world_for_device) is NCCL's, bootstrapped over MPI,
    so load_pipeline(device='cuda') finds the backend it needs instead of an MPI world."""
    proc = _under_mpiexec_with_the_fake("device")
    assert "WORLD nccl" in proc.stdout, proc.stdout


def _under_mpiexec_with_the_fake(mode: str) -> subprocess.CompletedProcess:
    """One rank under mpiexec, the NCCL backend opening the fake CUDA/NCCL library (its device
    memory viewed as the host's, so a CPU-only torch runs)."""
    pytest.importorskip("torch")
    fake = str(_fake_library())
    env = {**os.environ, **MPI_ENV, "HSDP_NCCL_LIBRARY": fake, "HSDP_CUDART_LIBRARY": fake, "FAKE_HOST_VIEW": "1"}
    proc = subprocess.run([mpiexec(), "-n", "1", sys.executable, "-c", _LOAD_CUDA, mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


_FREE_BYTES = r"""
import sys
from hsdp import _C
from hsdp.engine import residency
_C.nccl_load(sys.argv[1], sys.argv[1])
print("HOST", _C.device_free_bytes("host"))
print("CUDA", _C.device_free_bytes("cuda"))
print("BUDGET", residency.free_bytes("cuda"), "torch" in sys.modules)
"""


def test_device_memory_query_needs_no_framework():
    """The device interface's memory query (hsdp_device_i.mem_free; NCCL: cudaMemGetInfo, here
    the fake's FAKE_FREE_BYTES): _C.device_free_bytes names the GPU's free bytes, None for host
    memory, and the residency budget reads it without importing torch."""
    fake = str(_fake_library())
    env = {k: v for k, v in os.environ.items() if k != "FAKE_HOST_VIEW"}
    env["FAKE_FREE_BYTES"] = "123456789"
    proc = subprocess.run([sys.executable, "-c", _FREE_BYTES, fake], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "HOST None" in proc.stdout and "CUDA 123456789" in proc.stdout, proc.stdout
    assert "BUDGET 123456789 False" in proc.stdout, proc.stdout


def test_backend_loaders_are_found_by_the_backends_name():
    """A new device kind's Python loader needs no registry line (docs/design.md, "A new device
    kind"): hsdp.world.<name> when it marks itself a loader; C-only backends have none, and a
    module of hsdp.world that is not a backend's loader, or a name C does not register, gets none."""
    from hsdp.world import devices, nccl

    assert devices.loader("nccl") is nccl
    assert devices.loader("mpi") is None and devices.loader("single") is None
    assert devices.loader("job") is None  # a module of hsdp.world, but no backend of that name
    assert devices.loader("../nccl") is None
    registered = [b[0] for b in _C.backends()]
    assert registered[:3] == ["single", "mpi", "nccl"]  # csrc/backends.def's order
    c_lines = (ROOT / "csrc" / "backends.def").read_text()
    for name in registered:
        assert f"BACKEND({name})" in c_lines, name
