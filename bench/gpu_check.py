"""The first run of the NCCL backend on a GPU (one H200: an NCCL world of one), step by step.

    python bench/gpu_check.py             # on a GPU: every step; $OUT/gpu_check.json when OUT is set
    python bench/gpu_check.py --dry-run   # without a GPU: against csrc/tests/bin/fake_cuda_nccl.so
                                          # (make csrc/tests/bin/fake_cuda_nccl.so builds it)

Each step is independent (one that fails or raises does not stop the others) and ends in one
verdict line: PASS, FAIL, NEEDS-GPU (a dry run: the step needs a real GPU) or ERROR (it raised).

1. ``last_error``: hsdp's calls leave no CUDA error for torch. Gathers are started while the
   gather stream is busy (``torch.cuda._sleep`` there; the fake holds the stream), so hsdp
   polls events that are not ready; then a torch kernel runs (its launch check reads the last
   error) and ``cudaGetLastError`` of the shared libcudart is 0.
2. ``ordering``: a consumer on another stream reads a gathered buffer only once the gather
   has landed: the gather stream is kept busy, the buffer is read through
   ``torch.from_dlpack`` on a side stream (DLPack's stream argument), and what it read is
   compared with the weights; the same for ``all_gather_device`` on a given stream.
3. ``init``: the world and a split communicator run a barrier; a gathered buffer's
   ``__dlpack_device__`` is the rank's GPU; ``/proc/self/maps`` holds one libnccl and one
   libcudart (hsdp opened torch's, not others).
4. ``buffers_flat``: after a warm-up, steady unshard/reshard rounds allocate no new buffer
   (``buffer_allocs`` flat); on a GPU, over steady forwards of a stock Wan too.
5. ``parity_bf16``: a stock diffusers ``WanTransformer3DModel`` (1.3B-like blocks, 6 of them)
   sharded onto the GPU in bf16 against the same weights unsharded on the GPU: bit for bit.
6. ``start_unshard_us``: the host time of ``Unit.start_unshard`` on a block (it only
   enqueues on the gather stream); goal at most 50 us (median).
7. ``overlap``: per block, the next block's gather against this block's compute, with CUDA
   events: the gather's begin is the later of an event on the gather stream recorded before
   the start and one on the compute stream after the reshard the gather waits for (the
   gather stream cannot begin earlier), its end an event on the gather stream recorded after
   the start; goal: most of the gather time inside compute.
8. ``wire_fp8``: the float8 wire: a device unit's gathered bytes (fp8 + scales, dequantized by
   the NVRTC kernel on the gather stream) equal the host decode of the same weights, byte for
   byte; on a GPU a stock Wan with ``wire_dtype`` is within a relative L2 error of 0.05 of
   the bf16 sharded output.

Without a GPU and without ``--dry-run`` it says so and exits 2. Exit status: 0 when no step
failed or raised, 1 otherwise. Nothing here changes the card's settings. The GPU half of
every step is **untested on a GPU** (none has been lent to this project yet).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FAKE = ROOT / "csrc" / "tests" / "bin" / "fake_cuda_nccl.so"

WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=6, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
)
SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep on the gather stream: about 0.1 s at 2 GHz


class NeedsGPU(Exception):
    """A step (or the rest of one) that only a real GPU can run."""


@dataclass
class Env:
    dry: bool
    torch: Any
    world: Any
    device: int
    cudart: Any  # ctypes handle of the libcudart hsdp opened (the fake in a dry run)
    fake: Any = None  # the fake's controls (dry run only)
    fake_path: str = ""
    results: dict[str, dict] = field(default_factory=dict)


# ---------------------------------------------------------------------------- helpers
def _unit(env: Env, name: str, nbytes: int, value: int) -> tuple[Any, bytes]:
    """A device unit of one uint8 parameter filled with a pattern, not yet gathered."""
    import numpy as np

    from hsdp import _C

    data = ((np.arange(nbytes, dtype=np.uint32) * 31 + value) % 251 + 1).astype(np.uint8)
    u = _C.Unit(env.world, ["uint8"], [(nbytes,)], name=name, device="cuda")
    u.write(0, data)
    return u, data.tobytes()


def _fake_stream(env: Env) -> int:
    s = ctypes.c_void_p()
    if env.cudart.cudaStreamCreateWithPriority(ctypes.byref(s), 1, 0) != 0:
        raise RuntimeError("the fake could not create a stream")
    return int(s.value)


def _fake_device_copy(env: Env, stream: int, src: int, n: int) -> int:
    """A device buffer (the fake's memory is host memory) and a copy into it on `stream`."""
    dst = ctypes.c_void_p()
    if env.cudart.cudaMalloc(ctypes.byref(dst), ctypes.c_size_t(n)) != 0:
        raise RuntimeError("the fake could not allocate")
    env.cudart.cudaMemcpyAsync(dst, ctypes.c_void_p(src), ctypes.c_size_t(n), 4, ctypes.c_void_p(stream))
    return int(dst.value)


def _busy_gather_stream(env: Env) -> Callable[[], None]:
    """Keeps the gather stream busy; returns what lets it go."""
    from hsdp import _C

    comm = _C.nccl_comm_stream()
    if env.dry:
        env.fake.fake_stream_hold(ctypes.c_void_p(comm), 1)
        return lambda: env.fake.fake_stream_hold(ctypes.c_void_p(comm), 0)
    torch = env.torch
    with torch.cuda.stream(torch.cuda.ExternalStream(comm)):
        torch.cuda._sleep(SLEEP_CYCLES)
    return lambda: None


def _wan(torch: Any, seed: int = 0) -> Any:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**WAN).eval()


def _inputs(torch: Any) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 4, 64, 64, generator=g)  # 4 x 32 x 32 patches = 4096 tokens
    ctx = torch.randn(1, 128, 4096, generator=g)
    return (x.cuda(), torch.tensor([500], device="cuda"), ctx.cuda()), {"return_dict": False}


def _is_block(name: str, module: object) -> bool:
    return name.startswith("blocks.") and name.count(".") == 1


def _sharded_wan(env: Env) -> Any:
    import hsdp

    model = _wan(env.torch)
    model._hsdp_shard_conditions = [_is_block]
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="bfloat16"),
                             target_device="cuda")
    return model


# ---------------------------------------------------------------------------- the steps
def step_last_error(env: Env) -> dict:
    import numpy as np

    units = [_unit(env, f"last_error.{i}", 1 << 20, i) for i in range(3)]
    for u, _ in units:  # uploads, outside the busy window
        u.unshard(), u.reshard()
    release = _busy_gather_stream(env)
    for u, _ in units:  # each start polls the events of those still running: cudaErrorNotReady
        u.start_unshard()
    for u, _ in units:
        u.wait()
    release()
    for u, _ in units:
        u.reshard()
    out = np.zeros(4, np.int32)
    env.world.all_gather(np.arange(4, dtype=np.int32), out)  # staged, waited for on the host
    err = int(env.cudart.cudaGetLastError())
    res: dict[str, Any] = {"cudaGetLastError": err}
    if err != 0:
        return {**res, "verdict": "FAIL", "why": f"hsdp left CUDA error {err} for the next launch check"}
    if env.dry:
        return {**res, "verdict": "PASS", "why": "no error left (fake); a torch kernel after it needs a GPU"}
    torch = env.torch
    t = torch.ones(1 << 20, device="cuda") * 2  # torch's launch check reads the last error
    res["torch_kernel_sum"] = float(t.sum().item())
    ok = res["torch_kernel_sum"] == 2.0 * (1 << 20)
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": "a torch kernel ran after hsdp's calls"}


def step_ordering(env: Env) -> dict:
    u, want = _unit(env, "ordering", 4 << 20, 7)
    # the upload, outside the busy window; then the pooled buffer the next gather reuses is
    # zeroed, so a consumer that does not wait reads zeros, not the weights of this gather
    u.unshard()
    old = u.buffers()[0]
    if env.dry:
        env.cudart.cudaStreamSynchronize(None)
        ctypes.memset(old.address, 0, old.nbytes)  # the fake's device memory is host memory
    else:
        env.torch.from_dlpack(old).zero_()  # on the compute stream, before the reshard's release
    del old
    u.reshard()
    release = _busy_gather_stream(env)
    u.start_unshard()
    u.wait()  # orders the compute stream only: a consumer elsewhere must order itself
    buf = u.buffers()[0]
    res: dict[str, Any] = {}
    if env.dry:
        consumer = _fake_stream(env)
        buf.__dlpack__(stream=consumer, max_version=(1, 0))  # what torch.from_dlpack does on that stream
        seen = _fake_device_copy(env, consumer, buf.address, len(want))
        res["consumer_waits_while_gather_pending"] = env.fake.fake_stream_settle(ctypes.c_void_p(consumer)) > 0
        release()
        env.cudart.cudaStreamSynchronize(ctypes.c_void_p(consumer))
        res["dlpack_consumer_reads_gathered"] = ctypes.string_at(seen, len(want)) == want
        env.cudart.cudaFree(ctypes.c_void_p(seen))
        env.cudart.cudaStreamDestroy(ctypes.c_void_p(consumer))
    else:
        torch = env.torch
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            seen_t = torch.from_dlpack(buf).clone()  # passes `side` as DLPack's stream
        release()
        torch.cuda.synchronize()
        res["dlpack_consumer_reads_gathered"] = bytes(seen_t.cpu().numpy().tobytes()[: len(want)]) == want
    u.reshard()
    # a device all-gather given a stream runs after that stream's work and before its next
    if env.dry:
        n = 1 << 16
        consumer = _fake_stream(env)
        src = ctypes.c_void_p()
        env.cudart.cudaMalloc(ctypes.byref(src), ctypes.c_size_t(n))
        ctypes.memset(src, 3, n)  # the fake's device memory is host memory
        dst = _fake_device_copy(env, consumer, src.value, n)  # a device buffer, then made stale below
        env.cudart.cudaStreamSynchronize(ctypes.c_void_p(consumer))
        ctypes.memset(dst, 0, n)
        release = _busy_gather_stream(env)
        env.world.all_gather_device(src.value, dst, n, consumer)
        seen = _fake_device_copy(env, consumer, dst, n)  # after the gather, on the consumer's stream
        res["all_gather_device_waits"] = env.fake.fake_stream_settle(ctypes.c_void_p(consumer)) > 0
        release()
        env.cudart.cudaStreamSynchronize(ctypes.c_void_p(consumer))
        res["all_gather_device"] = ctypes.string_at(seen, n) == b"\x03" * n
        for p in (src.value, dst, seen):
            env.cudart.cudaFree(ctypes.c_void_p(p))
        env.cudart.cudaStreamDestroy(ctypes.c_void_p(consumer))
    else:
        torch = env.torch
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            src = torch.full((1 << 20,), 3, dtype=torch.uint8, device="cuda")
            dst = torch.zeros_like(src)
            release = _busy_gather_stream(env)
            env.world.all_gather_device(src.data_ptr(), dst.data_ptr(), src.numel(), side.cuda_stream)
            total = int(dst.sum().item())  # on `side`, after the gather
        release()
        res["all_gather_device"] = total == 3 * (1 << 20)
    ok = all(v is True for k, v in res.items() if isinstance(v, bool))
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": "a consumer stream waits for the gather it reads"}


def step_init(env: Env) -> dict:
    from hsdp import _C

    env.world.barrier()
    sub = env.world.split(0, 0)
    sub.barrier()
    u, _ = _unit(env, "init", 1 << 16, 1)
    u.unshard()
    dl = tuple(u.buffers()[0].__dlpack_device__())
    u.reshard()
    libs: dict[str, set[str]] = {"libnccl": set(), "libcudart": set()}
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(None, 1)[-1] if "/" in line else ""
            for k in libs:
                if Path(path).name.startswith(k + ".so"):
                    libs[k].add(path)
    res = {"world": [env.world.rank, env.world.size], "split": [sub.rank, sub.size], "dlpack_device": list(dl),
           "nccl_version": _C.nccl_version(), "maps": {k: sorted(v) for k, v in libs.items()}}
    ok = dl == (2, env.device) and sub.size == env.world.size
    if env.dry:  # hsdp opened the fake, beside whatever torch mapped: nothing to compare
        return {**res, "verdict": "PASS" if ok else "FAIL",
                "why": "world, split, DLPack device (fake); one libnccl and one libcudart needs a GPU"}
    ok = ok and all(len(v) == 1 for v in libs.values())
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": "one NCCL, one CUDA runtime, the rank's own device"}


def step_buffers_flat(env: Env) -> dict:
    from hsdp import _C

    units = [_unit(env, f"flat.{i}", (i + 1) << 16, i)[0] for i in range(3)]
    _C.set_pool_capacity(len(units))  # what the schedule's pool_reserve does for a model

    def rounds(n: int) -> None:
        for _ in range(n):
            for u in units:
                u.start_unshard()
                u.wait()
                u.reshard()

    rounds(2)
    before = _C.memory_stats()["buffer_allocs"]
    rounds(5)
    res: dict[str, Any] = {"unit_rounds_new_allocs": _C.memory_stats()["buffer_allocs"] - before}
    if not env.dry:
        torch = env.torch
        model = _sharded_wan(env)
        args, kw = _inputs(torch)
        with torch.no_grad():
            for _ in range(2):
                model(*args, **kw)
            torch.cuda.synchronize()
            before = _C.memory_stats()["buffer_allocs"]
            for _ in range(3):
                model(*args, **kw)
            torch.cuda.synchronize()
        res["wan_forwards_new_allocs"] = _C.memory_stats()["buffer_allocs"] - before
    _C.set_pool_capacity(2)
    ok = all(v == 0 for v in res.values())
    why = "steady rounds allocate nothing" + ("; forwards of a Wan need a GPU" if env.dry else "")
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": why}


def step_parity_bf16(env: Env) -> dict:
    if env.dry:
        raise NeedsGPU("a stock Wan in bf16 on the GPU")
    import hsdp
    from hsdp.adapters.torch import unsharded_reference

    torch = env.torch
    ref = unsharded_reference(_wan(torch), "bfloat16").to("cuda")
    model = _sharded_wan(env)
    args, kw = _inputs(torch)
    with torch.no_grad():
        want = ref(*args, **kw)[0]
        got = [model(*args, **kw)[0] for _ in range(3)]  # the first records the order, later ones prefetch
    torch.cuda.synchronize()
    exact = all(torch.equal(want, g) for g in got)
    res = {"bit_exact": exact, "max_abs_diff": float((want.float() - got[-1].float()).abs().max()),
           "gather_paths": sorted({st.unit.gather_path for st in hsdp.get_units(model)})}
    return {**res, "verdict": "PASS" if exact else "FAIL", "why": "sharded against unsharded, bit for bit"}


def step_start_unshard_us(env: Env) -> dict:
    if env.dry:
        raise NeedsGPU("the fake's timings mean nothing")
    import hsdp

    model = _sharded_wan(env)
    unit = hsdp.get_units(model)[0].unit  # a block
    times = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        unit.start_unshard()
        t1 = time.perf_counter_ns()
        unit.wait()
        unit.reshard()
        times.append((t1 - t0) / 1000)
    env.torch.cuda.synchronize()
    med = statistics.median(times)
    res = {"median_us": med, "min_us": min(times), "block_unit_bytes": unit.total_bytes}
    return {**res, "verdict": "PASS" if med <= 50 else "FAIL", "why": "goal: at most 50 us"}


def step_overlap(env: Env) -> dict:
    if env.dry:
        raise NeedsGPU("CUDA events on real streams")
    from hsdp.world import nccl

    torch = env.torch
    model = _sharded_wan(env)
    comm = nccl.comm_stream()
    blocks = list(model.blocks)
    ev: dict[str, list] = {k: [] for k in ("g0", "g1", "c0", "c1", "rel")}

    def event(stream: Any = None) -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream) if stream is not None else e.record()
        return e

    hooks = []
    for b in blocks:
        # before hsdp's pre-hook (which starts the next block's gather): g0 on the gather stream
        hooks.append(b.register_forward_pre_hook(lambda m, a: ev["g0"].append(event(comm)), prepend=True))
        # after it: the gather is enqueued, so g1 on the gather stream marks its end
        hooks.append(b.register_forward_pre_hook(lambda m, a: (ev["g1"].append(event(comm)), ev["c0"].append(event()))))
        hooks.append(b.register_forward_hook(lambda m, a, o: ev["c1"].append(event())))
        # after hsdp's post-hook (the reshard, which records the release the gathers wait for)
        hooks.append(b.register_forward_hook(lambda m, a, o: ev["rel"].append(event())))
    args, kw = _inputs(torch)
    with torch.no_grad():
        model(*args, **kw)  # records the order
        for k in ev:
            ev[k].clear()
        model(*args, **kw)  # prefetching
    torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    base = ev["c0"][0]
    t = {k: [base.elapsed_time(e) for e in v] for k, v in ev.items()}
    rows, inside, total = [], 0.0, 0.0
    for i in range(len(blocks) - 1):  # the gather started in block i's pre-hook is block i+1's
        begin = max(t["g0"][i], t["rel"][i - 1] if i > 0 else t["g0"][i])
        end, c0, c1 = t["g1"][i], t["c0"][i], t["c1"][i]
        rows.append({"block": i, "compute_ms": [c0, c1], "next_gather_ms": [begin, end]})
        total += max(end - begin, 0.0)
        inside += max(min(end, c1) - max(begin, c0), 0.0)
    frac = inside / total if total > 0 else None
    res = {"rows": rows, "gather_ms_total": total, "gather_ms_inside_compute": inside, "fraction": frac}
    return {**res, "verdict": "PASS" if (frac or 0) > 0.5 else "FAIL", "why": "goal: over half the gather time inside compute"}


def step_gather_vs_copy(env: Env) -> dict:
    if env.dry:
        raise NeedsGPU("bandwidth on a real device")
    from hsdp import _C

    torch = env.torch
    nbytes, reps = 256 << 20, 50
    u = _C.Unit(env.world, ["bfloat16"], [(nbytes // 2,)], name="bench-256MiB", device="cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    u.unshard(), u.reshard(), dst.copy_(src)  # warm: the shard's upload, the pool, the copy kernel
    torch.cuda.synchronize()

    def timed(step: Callable[[], Any]) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            step()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / reps

    def gather() -> None:
        u.start_unshard()
        u.wait()
        u.reshard()

    ratios, g_ms, c_ms = [], [], []
    for _ in range(5):  # interleaved
        g = timed(gather)
        c = timed(lambda: dst.copy_(src))
        g_ms.append(g), c_ms.append(c), ratios.append(c / g)
    res = {"gather_256MiB_ms": statistics.median(g_ms), "d2d_copy_256MiB_ms": statistics.median(c_ms),
           "copy_over_gather": statistics.median(ratios)}
    ok = res["copy_over_gather"] >= 0.9
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": "a 256 MiB gather against a device copy: goal 0.9"}


def _wire_unit(group: Any, device: str) -> Any:
    """A unit of bfloat16, float32, int32 and float16 parameters sent as float8, filled."""
    import numpy as np

    from hsdp import _C

    u = _C.Unit(group, ["bfloat16", "float32", "int32", "float16"], [(3000,), (70, 19), (5,), (700,)], name="fp8",
                device=device, wire_dtype="float8_e4m3fn")
    rng = np.random.default_rng(0)
    u.write(0, (rng.standard_normal(3000) * 0.02).astype(np.float32))
    u.write(1, (rng.standard_normal((70, 19)) * 3).astype(np.float32))
    u.write(2, np.array([1, -2, 3, 1 << 30, 0], np.int32))
    u.write(3, (rng.standard_normal(700) * 1e-3).astype(np.float32))
    return u


def step_wire_fp8(env: Env) -> dict:
    """The float8 wire on NCCL: a device unit's gathered fp8 + scales, dequantized by the kernel
    on the gather stream, equal the host decode of the same weights byte for byte; on a GPU, a
    stock Wan with wire_dtype within a relative L2 error of 0.05 of the bf16 sharded output."""
    from hsdp import _C
    from hsdp.world import nccl

    if env.dry:
        _C.wire_cuda_load(env.fake_path, env.fake_path)  # the fake's NVRTC and driver run the kernel's text
    else:
        nccl.load_wire_kernel()
    ref = _wire_unit(_C.ProcessGroup("single"), "host")
    ref.unshard()
    want = ctypes.string_at(ref.buffers()[0].address, ref.total_bytes)
    ref.reshard()
    u = _wire_unit(env.world, "cuda")
    same = []
    for _ in range(2):  # the first gather encodes and uploads the shard, the second reads it there
        u.start_unshard()
        u.wait()
        buf = u.buffers()[0]
        if env.dry:
            env.cudart.cudaStreamSynchronize(None)
            got = ctypes.string_at(buf.address, buf.nbytes)
        else:
            got = env.torch.from_dlpack(buf).cpu().numpy().tobytes()
        same.append(got == want)
        del buf
        u.reshard()
    res: dict[str, Any] = {"bytes_equal_host": same, "wire_chunk_bytes": u.wire_chunk_bytes, "chunk_bytes": u.chunk_bytes}
    if env.dry:
        return {**res, "verdict": "PASS" if all(same) else "FAIL",
                "why": "the kernel's text on the fake's stream equals the host decode; a Wan needs a GPU"}
    import hsdp

    torch = env.torch
    args, kw = _inputs(torch)
    bf16 = _sharded_wan(env)
    fp8 = _wan(torch)
    fp8._hsdp_shard_conditions = [_is_block]
    hsdp.apply_hsdp_to_model(fp8, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="bfloat16",
                                                           wire_dtype="float8_e4m3fn"), target_device="cuda")
    with torch.no_grad():
        want_out = bf16(*args, **kw)[0].float()
        got_out = fp8(*args, **kw)[0].float()
    rel = float((got_out - want_out).norm() / want_out.norm())
    res["wan_rel_l2"] = rel
    ok = all(same) and rel <= 0.05
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": "GPU decode == host decode; Wan rel L2 <= 0.05"}


STEPS: list[tuple[str, Callable[[Env], dict]]] = [
    ("last_error", step_last_error),
    ("ordering", step_ordering),
    ("init", step_init),
    ("buffers_flat", step_buffers_flat),
    ("parity_bf16", step_parity_bf16),
    ("start_unshard_us", step_start_unshard_us),
    ("overlap", step_overlap),
    ("gather_vs_copy", step_gather_vs_copy),
    ("wire_fp8", step_wire_fp8),
]


# ---------------------------------------------------------------------------- setting up
def setup(dry: bool, fake: Path) -> Env:
    from hsdp import _C

    torch = None
    try:
        import torch
    except ImportError:
        if not dry:
            raise
    if dry:
        if not fake.is_file():
            raise FileNotFoundError(f"no fake CUDA/NCCL library at {fake}: build it with "
                                    f"'make csrc/tests/bin/fake_cuda_nccl.so'")
        _C.nccl_load(str(fake), str(fake))
        lib = ctypes.CDLL(str(fake))  # the same handle the backend opened
        lib.cudaGetLastError.restype = ctypes.c_int
        _C.nccl_bootstrap(_C.nccl_unique_id(), 0, 1, 0)
        return Env(dry=True, torch=torch, world=_C.ProcessGroup("nccl"), device=0, cudart=lib, fake=lib,
                   fake_path=str(fake.resolve()))
    import hsdp
    from hsdp.world import nccl

    world = hsdp.distributed.init_process_group("nccl")
    lib = ctypes.CDLL(nccl.library_paths()[1])
    lib.cudaGetLastError.restype = ctypes.c_int
    return Env(dry=False, torch=torch, world=world, device=torch.cuda.current_device(), cudart=lib)


def run(env: Env, only: list[str] | None = None) -> int:
    bad = 0
    for name, fn in STEPS:
        if only and name not in only:
            continue
        t0 = time.time()
        try:
            res = fn(env)
        except NeedsGPU as exc:
            res = {"verdict": "NEEDS-GPU", "why": str(exc)}
        except Exception as exc:  # every step reports, even after one raises
            res = {"verdict": "ERROR", "why": f"{type(exc).__name__}: {exc}"}
        res["seconds"] = round(time.time() - t0, 2)
        env.results[name] = res
        bad += res["verdict"] in ("FAIL", "ERROR")
        detail = {k: v for k, v in res.items() if k not in ("verdict", "why")}
        print(f"{name:<17} {res['verdict']:<9} {res['why']}  {json.dumps(detail)[:1500]}", flush=True)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="run against the fake CUDA/NCCL library, no GPU")
    ap.add_argument("--fake", type=Path, default=FAKE, help="the fake library for --dry-run")
    ap.add_argument("--step", action="append", choices=[n for n, _ in STEPS], help="run only these steps")
    args = ap.parse_args(argv)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no GPU is visible (torch.cuda.is_available() is False); this check needs one "
                  "(--dry-run runs it against the fake library)", file=sys.stderr)
            return 2
    env = setup(args.dry_run, args.fake)
    mode = "dry run against the fake CUDA/NCCL (no GPU)" if env.dry else f"GPU {env.device}"
    print(f"gpu_check: {mode}", flush=True)
    status = run(env, args.step)
    dest = os.environ.get("OUT")
    if dest and not env.dry:
        Path(dest, "gpu_check.json").write_text(json.dumps(env.results, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
