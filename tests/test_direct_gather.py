"""Direct gathers: from a unit's second gather on, ranks on one host read each other's shards
with process_vm_readv instead of an MPI collective (see docs/design.md, "Direct gathers")."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from mpirun import run_ranks

import hsdp
from hsdp import models


def process_vm_readv_works() -> bool:
    """Whether one process may read a sibling's memory, as ranks (children of one launcher)
    read each other's: containers' seccomp profiles and Yama's ptrace_scope >= 1 forbid it."""
    libc = ctypes.CDLL(None, use_errno=True)

    class Iov(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    buf = ctypes.create_string_buffer(b"hsdp-probe")  # the same address in both children
    r, w = os.pipe()
    holder = os.fork()
    if holder == 0:  # keeps its copy of buf until the reader is done
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    reader = os.fork()
    if reader == 0:
        out = ctypes.create_string_buffer(len(buf.raw))
        local = Iov(ctypes.cast(out, ctypes.c_void_p), len(out.raw))
        remote = Iov(ctypes.cast(buf, ctypes.c_void_p), len(buf.raw))
        n = libc.process_vm_readv(holder, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        os._exit(0 if n == len(buf.raw) and out.raw == buf.raw else 1)
    _, status = os.waitpid(reader, 0)
    os.close(r)
    os.write(w, b"x")
    os.close(w)
    os.waitpid(holder, 0)
    return os.waitstatus_to_exitcode(status) == 0


DIRECT = "direct" if process_vm_readv_works() else "collective"


@pytest.mark.parametrize("n", [2, 4])
def test_units_gather_directly_after_the_first_gather(n):
    out = run_ranks(n, "tests/direct_worker.py", DIRECT, "paths").stdout
    assert out.count("paths ok") == n, out


def test_direct_gathers_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("HSDP_DIRECT_GATHER", "0")
    out = run_ranks(2, "tests/direct_worker.py", "collective", "paths").stdout
    assert out.count("paths ok") == 2, out


def test_a_peer_dropping_its_model_early_does_not_pull_shards_from_under_a_reader():
    out = run_ranks(2, "tests/direct_worker.py", DIRECT, "late_peer").stdout
    assert out.count("late peer ok") == 2, out


def test_a_world_of_one_gathers_collectively_and_fixes_the_shard():
    hsdp.distributed.init_process_group("single")
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=3)
    model(*x)
    st = hsdp.get_units(model)[0]
    assert st.unit.gather_path == "collective"
    with pytest.raises(RuntimeError, match="fixed"):
        st.unit.write(0, np.zeros(st.params[0].numel(), dtype=np.float32))
