"""The float8 wire (HSDPInferenceConfig(wire_dtype="float8_e4m3fn")): the config, the flags,
the Unit's encoding in one process. On 2 real MPI ranks, a stock diffusers Wan in bfloat16
(tests/torch_worker.py's "wire", run in test_torch.py::test_parity_across_ranks[mesh0] to
share its launch): shards <= 0.56 of the bfloat16 ones, a forward within a relative L2 error
of 0.05, the kept float32 modules unquantized, hsdp.wire_error within e4m3's bound. The block
quantizer's own checks (exact, bounded, zeros, NaN/inf) are C tests: csrc/tests/test_dtype.c,
test_core.c and test_mpi.c."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

import hsdp
from hsdp import _C
from hsdp.engine.config import DiffusionParallelConfig, add_parallel_args
from hsdp.world.distributed import init_process_group

WORLD = init_process_group("single")


def test_config_field_default_repr_equality_and_refusals():
    c = hsdp.HSDPInferenceConfig(enabled=True)
    assert c.wire_dtype is None and "wire_dtype=None" in repr(c)
    w = hsdp.HSDPInferenceConfig(enabled=True, wire_dtype="float8_e4m3fn")
    assert w.wire_dtype == "float8_e4m3fn" and "wire_dtype='float8_e4m3fn'" in repr(w) and w != c
    c.wire_dtype = "float8_e4m3fn"
    assert c == w
    c.wire_dtype = None
    assert c.wire_dtype is None
    with pytest.raises(NotImplementedError, match="float8_e5m2"):
        hsdp.HSDPInferenceConfig(wire_dtype="float8_e5m2")
    with pytest.raises(ValueError, match="wire_dtype must be 'float8_e4m3fn' or None, got bfloat16"):
        hsdp.HSDPInferenceConfig(wire_dtype="bfloat16")
    with pytest.raises(TypeError, match="wire_dtype"):
        hsdp.HSDPInferenceConfig(wire_dtype="fp9")


def test_parallel_config_and_flag():
    p = argparse.ArgumentParser()
    add_parallel_args(p)
    args = p.parse_args(["--use-hsdp", "--hsdp-shard-size", "2", "--hsdp-wire-dtype", "float8_e4m3fn"])
    c = DiffusionParallelConfig.from_cli_args(args)
    assert c.hsdp_wire_dtype == "float8_e4m3fn"
    assert c.to_hsdp_config().wire_dtype == "float8_e4m3fn"
    assert DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=2).to_hsdp_config().wire_dtype is None
    assert c.replace(hsdp_shard_size=4).hsdp_wire_dtype == "float8_e4m3fn"
    with pytest.raises(ValueError, match="hsdp_wire_dtype must be None or one of float8_e4m3fn, got 'int8'"):
        DiffusionParallelConfig(hsdp_wire_dtype="int8")
    with pytest.raises(NotImplementedError, match="float8_e5m2"):
        DiffusionParallelConfig(hsdp_wire_dtype="float8_e5m2")
    with pytest.raises(SystemExit):
        p.parse_args(["--hsdp-wire-dtype", "float8_e5m2"])


def _unit(quant=None, device="host"):
    params = [type("P", (), {})() for _ in range(3)]
    host = device == "host"
    return _C.Unit(
        WORLD, ["bfloat16", "float32", "float8_e5m2"], [(300,), (4,), (8,)], params=params, name="u",
        compute_dtypes=["float32" if host else "bfloat16", "float32", "float32" if host else "float8_e5m2"],
        bind_attr="data" if host else None, device=device, wire_dtype="float8_e4m3fn", wire_params=quant,
    ), params


def test_unit_encodes_gathers_dequantizes_and_reports_its_error():
    u, params = _unit()
    assert u.wire_dtype == "float8_e4m3fn" and u.wire_params == (True, True, False)  # float8 stays as it is
    x = (np.sin(np.arange(300) * 0.3) * 0.05).astype(np.float32)
    u.write(0, x)
    u.write(1, np.array([1.0, -2.0, 0.0, 448.0], np.float32))
    u.write(2, np.arange(8, dtype=np.float32))
    err = u.wire_error()
    assert 0 < err["max_abs_error"] <= err["max_abs_value"] * 2**-4 * 1.01
    before = hsdp.memory_stats()["sharded_bytes"]
    u.encode()
    assert u.is_encoded and len(u.shard_bytes()) == u.wire_chunk_bytes < u.chunk_bytes
    assert hsdp.memory_stats()["sharded_bytes"] == before - u.chunk_bytes + u.wire_chunk_bytes
    assert u.wire_error() is None  # the source is gone
    with pytest.raises(RuntimeError, match="encoded as float8"):
        u.write(0, x)
    u.unshard()
    bf = x.astype(np.float32)  # the bfloat16 source, as the unit stored it
    assert np.all(np.abs(params[0].data - bf) <= np.abs(bf) * 0.075 + 0.05 / 448 / 1024 + 1e-3 * np.abs(bf))
    assert params[1].data.tolist() == [1.0, -2.0, 0.0, 448.0]  # 448 sets the scale: exact
    assert params[2].data.tolist() == list(range(8))
    u.reshard()


def test_unit_refusals():
    if not _C.wire_cuda_loaded():  # on the GPU a kernel dequantizes: loaded first (tests/test_nccl.py)
        with pytest.raises(NotImplementedError, match=r"GPU kernel that is not loaded: call hsdp.nccl.load_wire_kernel"):
            _unit(device="cuda")
    with pytest.raises(TypeError, match="parameter 2 is stored as float8_e5m2"):
        _unit(quant=[True, False, True])
    with pytest.raises(ValueError, match="got 2 wire_params but unit 'u' has 3 parameters"):
        _unit(quant=[True, False])
    u, _ = _unit(quant=[False, False, False])  # nothing marked: the unit travels as stored
    assert u.wire_dtype is None and u.wire_chunk_bytes == u.chunk_bytes



def test_wire_piece_knob():
    """_C._set_wire_piece_bytes: the float8 wire's pieces on MPI (the protocol itself is tested
    across 4 ranks in csrc/tests/test_mpi.c); off by default, returns the previous value."""
    assert _C._set_wire_piece_bytes(1 << 18) == 0
    assert _C._set_wire_piece_bytes(0) == 1 << 18
    with pytest.raises(ValueError, match="bytes must be >= 0 .0: one message., got -1"):
        _C._set_wire_piece_bytes(-1)
    with pytest.raises(TypeError):
        _C._set_wire_piece_bytes("64")
