"""The NCCL backend on a machine without a GPU: it is built and registered, asking for it
fails at once with a clear error that leaves torch (and hsdp on the CPU) working, and the
bootstrap carries rank 0's unique id to every rank over MPI and over torch's TCPStore.
The GPU paths themselves run in bench/gpu_check.py (docs/performance.md says where)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import hsdp
from hsdp import _C
from hsdp.world import nccl
from mpirun import MPI_ENV, mpiexec

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "nccl_worker.py")
_IDS = re.compile(r"via=(\w+) rank=(\d+) size=(\d+) len=(\d+) id=([0-9a-f]{64})")

torch = pytest.importorskip("torch")
NO_GPU = not torch.cuda.is_available()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fake_library() -> Path:
    """The fake CUDA/NCCL library (csrc/tests/fake_cuda_nccl.c), built if it is not."""
    built = subprocess.run(["make", "-s", "csrc/tests/bin/fake_cuda_nccl.so"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    return ROOT / "csrc" / "tests" / "bin" / "fake_cuda_nccl.so"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(extra)
    return env


def _ranks(out: str) -> list[tuple[str, int, int, int, str]]:
    return sorted((m[0], int(m[1]), int(m[2]), int(m[3]), m[4]) for m in _IDS.findall(out))


def _assert_one_id(rows: list[tuple[str, int, int, int, str]], via: str, n: int) -> None:
    assert [r[1] for r in rows] == list(range(n)), rows
    assert all(r[0] == via and r[2] == n and r[3] == nccl.ID_BYTES for r in rows), rows
    assert len({r[4] for r in rows}) == 1, f"the ranks hold different ids: {rows}"


def test_backend_is_built_and_registered():
    """Built (every build is: csrc/cuda_abi.h, no CUDA header needed), registered as 'nccl', and
    the libraries it would open are the ones torch loaded."""
    assert _C.nccl_built()
    assert "nccl" in hsdp.distributed.backends()
    lib, rt = nccl.library_paths()
    assert Path(lib).name.startswith("libnccl.so") and Path(lib).is_file()
    assert Path(rt).name.startswith("libcudart.so") and Path(rt).is_file()
    loaded = Path("/proc/self/maps").read_text()
    assert lib in loaded and rt in loaded  # torch's own copies, not a system NCCL


# A fresh process that never loads NCCL (nor imports torch), so the refusals run whether or
# not this machine has a GPU.
_UNLOADED_SCRIPT = r"""
from hsdp import _C
assert _C.nccl_built() and _C.nccl_version() == 0
for call in (_C.nccl_unique_id, lambda: _C.ProcessGroup("nccl"), lambda: _C.nccl_bootstrap(b"abc", 0, 1, 0)):
    try:
        call()
        print("NO ERROR")
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
"""


def test_unloaded_backend_refuses_clearly():
    """Before loading: no unique id, no world; a bad id length is a ValueError."""
    proc = subprocess.run([sys.executable, "-c", _UNLOADED_SCRIPT], cwd=ROOT, env=_clean_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "RuntimeError: the NCCL library is not loaded yet", lines
    assert lines[1].startswith("NotImplementedError: the NCCL backend is built but its libraries are not loaded"), lines
    assert lines[2] == "ValueError: an NCCL unique id is 128 bytes, got 3", lines


_NO_GPU_SCRIPT = r"""
import torch, hsdp
from hsdp import _C
from diffusers import WanTransformer3DModel
errors = []
for call in (lambda: hsdp.distributed.init_process_group("nccl"), lambda: hsdp.init_device_mesh("cuda", (1, 1))):
    try:
        call()
    except RuntimeError as exc:  # no GPU: a RuntimeError as torch raises, not NotImplementedError
        assert type(exc) is RuntimeError, repr(exc)
        errors.append(str(exc))
assert len(errors) == 2, errors
print("ERR", errors[0])
assert _C.nccl_version() == 0 and not hsdp.distributed.is_initialized()  # nothing half loaded
cfg = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
           text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
torch.manual_seed(0)
model = WanTransformer3DModel(**cfg).eval()
try:
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True), target_device="cuda")
except RuntimeError as exc:
    assert type(exc) is RuntimeError, repr(exc)
    print("ERR2", exc)
assert not hasattr(model.blocks[0], "_hsdp_unit") and model.blocks[0].attn1.to_q.weight.shape == (16, 16)
# torch still works, and so does hsdp on the CPU
x = torch.randn(1, 4, 2, 8, 8); t = torch.tensor([500]); e = torch.randn(1, 5, 16)
with torch.no_grad():
    ref = model(x, t, e, return_dict=False)[0]
    model._hsdp_shard_conditions = [lambda name, m: type(m).__name__ == "WanTransformerBlock"]
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"), target_device="cpu")
    out = model(x, t, e, return_dict=False)[0]
print("WORLD", hsdp.distributed.get_world_group().backend, "EXACT", bool(torch.equal(ref, out)))
"""


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_no_gpu_is_a_clear_error_and_torch_still_works():
    """init_process_group('nccl'), init_device_mesh('cuda') and target_device='cuda' each raise
    RuntimeError at once, naming cudaGetDeviceCount's error; nothing stays loaded, the model is untouched,
    and afterwards torch and hsdp on the CPU (a world of one) still work, exactly."""
    proc = subprocess.run([sys.executable, "-c", _NO_GPU_SCRIPT], cwd=ROOT, env=_clean_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"ERR no usable GPU for the NCCL backend: cudaGetDeviceCount failed with CUDA error \d+ \(",
                     proc.stdout), proc.stdout
    assert "ERR2 target_device 'cuda' needs a GPU: no usable GPU for the NCCL backend" in proc.stdout
    assert "WORLD single EXACT True" in proc.stdout


def test_a_library_that_is_not_there_is_named():
    """HSDP_NCCL_LIBRARY naming a missing file: the error names it, nothing is loaded."""
    script = ("import hsdp\ntry:\n    hsdp.distributed.init_process_group('nccl')\nexcept NotImplementedError as e:\n"
              "    print('ERR', e)\nprint('LOADED', hsdp._C.nccl_version())\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=_clean_env(HSDP_NCCL_LIBRARY="/nonexistent/libnccl.so.2"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERR could not open the NCCL library '/nonexistent/libnccl.so.2'" in proc.stdout
    assert "LOADED 0" in proc.stdout


def test_unique_id_over_mpi_broadcast():
    """Under mpiexec, rank 0's id reaches every rank by MPI broadcast (3 ranks)."""
    env = {**_clean_env(), **MPI_ENV}
    proc = subprocess.run([mpiexec(), "-n", "3", sys.executable, WORKER], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_one_id(_ranks(proc.stdout), "mpi", 3)


def _torchrun_ranks(n: int, port: int, ranks: list[int], timeout: float = 30, **extra: str) -> list[subprocess.Popen]:
    procs = []
    for r in ranks:
        env = _clean_env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(port), **extra)
        procs.append(subprocess.Popen([sys.executable, WORKER, str(timeout)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _collect(procs: list[subprocess.Popen]) -> tuple[list[int], str]:
    outs = [p.communicate(timeout=120)[0] for p in procs]
    return [p.returncode for p in procs], "".join(outs)


def test_unique_id_over_tcpstore_served_by_rank0():
    """torchrun's variables without an agent store: rank 0 serves a TCPStore at
    MASTER_ADDR:MASTER_PORT on loopback and the others read the id from it (2 ranks)."""
    codes, out = _collect(_torchrun_ranks(2, _free_port(), [0, 1]))
    assert codes == [0, 0], out
    _assert_one_id(_ranks(out), "torchrun", 2)


def test_unique_id_over_the_agent_store():
    """TORCHELASTIC_USE_AGENT_STORE=True: the agent (here, this test) serves the store, and
    every rank, rank 0 included, connects to it as a client (3 ranks)."""
    from torch.distributed import TCPStore

    port = _free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    codes, out = _collect(_torchrun_ranks(3, port, [0, 1, 2], TORCHELASTIC_USE_AGENT_STORE="True",
                                          TORCHELASTIC_RESTART_COUNT="2"))
    assert codes == [0, 0, 0], out
    _assert_one_id(_ranks(out), "torchrun", 3)
    assert store.check(["hsdp/nccl_unique_id/2"])  # keyed by the restart, so a restarted job never reads a stale id


def test_a_missing_rank0_ends_the_wait_naming_it():
    """Rank 0 never starts: rank 1's wait for the id ends after the timeout (2 s) with an error
    naming rank 0 and the store's address, not a hang."""
    from torch.distributed import TCPStore

    port = _free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    codes, out = _collect(_torchrun_ranks(2, port, [1], timeout=2, TORCHELASTIC_USE_AGENT_STORE="True"))
    assert codes == [3], out
    assert f"rank 1: rank 0 did not publish the NCCL unique id at 127.0.0.1:{port} within 2 s" in out
    del store


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 is outside WORLD_SIZE=2"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK must be an integer, got 'x'"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT must be a TCP port"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is not set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "-1"},
         "LOCAL_RANK must be >= 0"),
    ],
)
def test_bad_launcher_variables_are_named(env, message, monkeypatch):
    for k in [k for k in os.environ if k.startswith(("OMPI_", "PMI", "PMIX_"))]:
        monkeypatch.delenv(k)
    with pytest.raises(ValueError, match=re.escape(message)):
        nccl.launch_info(env)


def test_launch_info_reads_torchrun_and_single():
    info = nccl.launch_info({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                             "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (info.via, info.rank, info.size, info.local_rank, info.master_port, info.agent_store) == (
        "torchrun", 1, 4, 1, 29500, True)


def test_rank0_names_the_ranks_that_never_read_the_id():
    """Rank 0 serves the store and waits for every rank to read the id (the store must outlive
    the reads); a rank that never comes is named after the timeout (2 s)."""
    codes, out = _collect(_torchrun_ranks(3, _free_port(), [0, 1], timeout=2))
    assert codes[0] == 3, out
    assert "rank 0: ranks [2] of 3 did not read the NCCL unique id" in out and "within 2 s" in out


def test_oom_handler_takes_a_callable_or_none():
    """torch.cuda.empty_cache is what init_world registers; anything else callable works, and
    None removes it (the retry itself runs in csrc/tests/test_nccl.c against the fake)."""
    with pytest.raises(TypeError, match="must be callable or None, got 5"):
        _C.nccl_set_oom_handler(5)
    _C.nccl_set_oom_handler(lambda: None)
    _C.nccl_set_oom_handler(None)


def test_fp8_wire_against_the_fake():
    """wire_dtype='float8_e4m3fn' on a device unit of the NCCL backend (tests/nccl_wire_fake.py,
    its own process): refused until hsdp.nccl.load_wire_kernel() has loaded NVRTC and the driver
    (here the fake, by HSDP_NVRTC_LIBRARY / HSDP_CUDA_DRIVER_LIBRARY); then each gather moves
    fp8 + scales and the kernel's own source, run by the fake on the side stream, gives the
    same bytes as the host path. The fake's driver refuses PTX (FAKE_REFUSE_PTX=1: older than
    the NVRTC, issue 30 L1): the kernel is a CUBIN for the device. Untested on a GPU."""
    fake = _fake_library()
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "nccl_wire_fake.py"),
                          str(fake)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=_clean_env(FAKE_REFUSE_PTX="1"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "device decode == host decode" in out.stdout


def test_fp8_wire_kernel_paths(monkeypatch):
    """NVRTC from HSDP_NVRTC_LIBRARY first, the driver by its soname unless
    HSDP_CUDA_DRIVER_LIBRARY names one; a missing NVRTC is named (the bfloat16 path never asks)."""
    monkeypatch.setenv("HSDP_NVRTC_LIBRARY", "/opt/x/libnvrtc.so.12")
    monkeypatch.delenv("HSDP_CUDA_DRIVER_LIBRARY", raising=False)
    assert nccl.wire_kernel_paths() == ("/opt/x/libnvrtc.so.12", "libcuda.so.1")
    monkeypatch.setenv("HSDP_CUDA_DRIVER_LIBRARY", "/opt/x/libcuda.so.1")
    assert nccl.wire_kernel_paths()[1] == "/opt/x/libcuda.so.1"
    monkeypatch.delenv("HSDP_NVRTC_LIBRARY")
    monkeypatch.setattr(nccl, "_site_dirs", lambda: [])
    monkeypatch.setattr(nccl, "_NVRTC_WHEELS", ())
    if "libnvrtc.so" not in Path("/proc/self/maps").read_text():
        with pytest.raises(NotImplementedError, match="no libnvrtc was found.*HSDP_NVRTC_LIBRARY"):
            nccl.wire_kernel_paths()
    if not _C.wire_cuda_loaded():  # a library that is not there: named, nothing left loaded
        with pytest.raises(NotImplementedError, match="could not open NVRTC '/nonexistent/libnvrtc.so.12'"):
            _C.wire_cuda_load("/nonexistent/libnvrtc.so.12", "libcuda.so.1")
        assert not _C.wire_cuda_loaded()


def test_torch_through_nccl_against_the_fake():
    """The torch adapter and the combined paths through the NCCL backend's own code, with a
    CPU-only torch (tests/nccl_torch_fake.py: a world of 2 ranks, then one of 4, forked over
    the fake's shared memory): under FAKE_HOST_VIEW=1 the fake says its device memory is host
    memory, the backend views its buffers as the CPU, every unit's buffers are NCCL's device
    buffers, and torch's CPU tensors go to NCCL as they are, as CUDA tensors do on a GPU. The
    stock Wan in float32 (with the agreement tickets) on the meshes 1x2, 2x1 and 2x2, and in
    bfloat16 (without: only the gather's own wait orders torch's reads after the fake's
    stream), and the stock Flux in bfloat16, equal the unsharded reference bit for bit over
    three forwards (and their gathered state dicts); HSDP x Ulysses, ring attention (its k/v
    blocks by the backend's grouped ncclSend/ncclRecv between the ranks) and ring x CFG match
    within 1e-5 (the MPI tests' tolerance), CFG parallel alone bit for bit."""
    fake = _fake_library()
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "nccl_torch_fake.py"),
                          str(fake), "2", "4"], cwd=ROOT,
                         capture_output=True, text=True, timeout=280, env=_clean_env(OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout + out.stderr
    cases = {2: ("ok wan float32 1x2 on nccl", "ok wan float32 2x1 on nccl", "ok wan bfloat16 1x2 on nccl",
                 "ok flux bfloat16 1x2 on nccl", "torch ulysses float32 ok on nccl", "torch ring ok on nccl (ring",
                 "torch cfg ok on nccl (cfg branch"),
             4: ("ok wan float32 2x2 on nccl", "torch ring x cfg ok on nccl (ring")}
    first, second = out.stdout.split("all 2 ranks ok\n")  # the world of 2, then the world of 4
    for n, text in ((2, first), (4, second)):
        for rank in range(n):
            for case in cases[n]:
                assert f"rank {rank}: {case}" in text, out.stdout
    assert second.endswith("all 4 ranks ok\n"), out.stdout
