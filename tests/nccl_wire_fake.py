"""The float8 wire on the NCCL backend from Python, against the fake CUDA/NCCL library (no
GPU): run by tests/test_nccl.py::test_fp8_wire_against_the_fake in its own process (the fake
is loaded as libnccl and libcudart, NVRTC and the driver). A device unit gathers fp8 + scales
and the fake runs the dequantization kernel's own source on the side stream; its unsharded
bytes equal the host path's (a single-process unit with the same weights)."""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

from hsdp import _C

from hsdp.world import nccl


def _unit(group: object, device: str) -> object:
    return _C.Unit(group, ["bfloat16", "float32", "int32", "float16"], [(300,), (7, 19), (5,), (70,)], name="fp8",
                   device=device, wire_dtype="float8_e4m3fn")


def _fill(u: object) -> None:
    rng = np.random.default_rng(0)
    u.write(0, (rng.standard_normal(300) * 0.02).astype(np.float32))
    u.write(1, (rng.standard_normal((7, 19)) * 3).astype(np.float32))
    u.write(2, np.array([1, -2, 3, 1 << 30, 0], np.int32))
    u.write(3, (rng.standard_normal(70) * 1e-3).astype(np.float32))


def main(fake: str) -> int:
    lib = ctypes.CDLL(fake)
    _C.nccl_load(fake, fake)
    _C.nccl_bootstrap(_C.nccl_unique_id(), 0, 1, 0)
    world = _C.ProcessGroup("nccl")
    try:
        _unit(world, "cuda")
    except NotImplementedError as exc:  # before the kernel is loaded: refused, saying what to call
        assert "hsdp.nccl.load_wire_kernel()" in str(exc), exc
    else:
        raise AssertionError("a device unit with a wire dtype was made before the kernel was loaded")
    os.environ["HSDP_NVRTC_LIBRARY"] = os.environ["HSDP_CUDA_DRIVER_LIBRARY"] = fake
    nccl.load_wire_kernel()
    assert _C.wire_cuda_loaded() and _C.wire_cuda_image() is None  # compiled at the first gather

    ref = _unit(_C.ProcessGroup("single"), "host")
    _fill(ref)
    ref.unshard()
    want = ctypes.string_at(ref.buffers()[0].address, ref.total_bytes)

    u = _unit(world, "cuda")
    _fill(u)
    launches = lib.fake_kernel_launches()
    for _ in range(2):  # the first gather encodes and uploads the shard; the second reads it there
        u.start_unshard()
        u.wait()
        lib.cudaStreamSynchronize(None)  # the compute stream waited for the kernel
        buf = u.buffers()[0]
        got = ctypes.string_at(buf.address, buf.nbytes)
        assert got == want, "the GPU decode differs from the host's"
        del buf
        u.reshard()
    assert lib.fake_kernel_launches() >= launches + 2
    assert _C.wire_cuda_image() == "cubin sm_90", _C.wire_cuda_image()  # for the fake's device: no PTX to JIT
    u.unshard()  # the synchronous form
    lib.cudaStreamSynchronize(None)
    assert ctypes.string_at(u.buffers()[0].address, u.total_bytes) == want
    u.reshard()
    assert u.is_encoded and len(u.shard_bytes()) == u.wire_chunk_bytes < u.chunk_bytes
    assert lib.cudaGetLastError() == 0
    print("fp8 wire on the fake NCCL: device decode == host decode")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
