"""The first run of the NCCL backend on 2 or more GPUs of one host, step by step.

    python3 bench/gpu_check_multi.py             # N = every visible GPU (at least 2); under 8 minutes
    python3 bench/gpu_check_multi.py --nproc 2   # 2 ranks on GPUs 0 and 1
    python3 bench/gpu_check_multi.py --dry-run   # without a GPU: 3 ranks against the fake library

Like bench/gpu_check.py it stands alone on a machine with a Python that has torch (and numpy):
it builds hsdp from this tree when it is not (a dry run also the fake CUDA/NCCL library),
prints the versions, and runs every step in processes of its own with its own time limit:
on GPUs one ``torchrun --standalone --nproc-per-node N`` job per step (the way
docs/launching.md starts hsdp on GPUs), in a dry run a process that forks its N ranks (the
fake's shared world is inherited). A step's ranks that give no result within its limit are
killed (TIMEOUT; ``faulthandler`` prints their tracebacks into the step's log 5 s before),
one that dies loses only that step. Steps run with ``HSDP_TIMEOUT=60`` and
``NCCL_DEBUG=WARN`` unless those are set; the whole check is held to 450 s (``--budget``).
The JSON ($OUT/gpu_check_multi.json, else ``--json`` or a temporary folder) is rewritten
after every step; each rank's own result and each step's log go to the folder
gpu_check_multi/ beside it. One verdict per step, combined over the ranks (the worst of
theirs), then a summary table. Exit status 0 when nothing failed, raised or timed out; 1
otherwise; 2 with fewer than 2 GPUs (and no --dry-run).

The steps (limits in STEPS; docs/performance.md has the table):
 1. ``preflight``: versions, the GPUs, ``nvidia-smi topo -m``.
 2. ``split_ranks``: splits of the world (one color by rank, by reversed key, by parity):
    each rank's place, a host all-gather in the split's order, a barrier; on each split an
    ``all_gather_device`` and a device sendrecv around its ring (plain and started), exact.
 3. ``mesh``: ``hsdp.init_device_mesh`` (two splits each) for (1, N), (N, 1) and (2, N/2):
    a barrier on each group, a unit gather on the shard group, exact.
 4. ``inplace_offsets``: a unit of odd-sized float32, bfloat16 and uint8 parameters over the
    world and over a split with reversed ranks, gathered twice; ``all_gather_device`` from a
    separate source and in place: every byte at its offset.
 5. ``allgather_bw``: S = 1, 16, 64, 256 MiB gathered as an hsdp unit (start_unshard, wait,
    reshard), as two units in flight, by ``all_gather_device`` and by torch.distributed's
    ``all_gather_into_tensor``; CUDA events, medians of interleaved rounds, busbw by
    nccl-tests' formula. Goal: the unit's busbw at least 0.9 of torch's from 64 MiB; exact.
 6. ``allgather_bw_agree_off``: the same at 64 and 256 MiB with the agreement tickets off
    (``_C._set_agreement_check(False)``, HSDP_AGREE_OFF), beside the default: what the
    tickets' host waits cost.
 7. ``parity_bf16``: the block model of gpu_check.py sharded over the N GPUs in bf16 against
    it unsharded on each: bit for bit, the same output on every rank.
 8. ``parity_wan``: the same for the stock diffusers Wan, and its float8 wire within 0.05
    (SKIPPED without diffusers).
 9. ``overlap``: the next block's NCCL gather against this block's compute (CUDA events).
10. ``ring_sendrecv``: ``sendrecv_start_device`` around the ring of the world and of a split
    with reversed ranks, N - 1 passes: every block arrives exact.
11. ``ulysses_a2a``: ``all_to_all_device`` over the world and over pairs: exact.
12. ``cfg_gather``: the CFG layout's split into groups of 2 (rank r with r + N/2): an
    ``all_gather_device`` and a host all_gather there, exact.
13. ``wire_fp8``: a device unit's float8 gather over the N ranks (NVRTC kernel) equals a host
    unit's over the same world, byte for byte, on every rank.
14. ``stray_contexts``: after gathers and the watchdog's polls, no rank r != 0 has a context on
    GPU 0 (the driver's primary-context state of device 0 in every rank; ``nvidia-smi
    --query-compute-apps`` or NVML listing the ranks' pids per GPU).
15. ``desync_same_size``, 16. ``desync_sizes``: even ranks unshard one unit, odd ranks another
    (same size; different sizes), ``HSDP_TIMEOUT=15``: every rank raises, none returns weights.
17. ``timeout_subgroups``: a (2, N/2) mesh (N = 2: (1, 2)) with every group connected; one
    rank skips a gather on its shard group while the world and replicate groups are alive,
    ``HSDP_TIMEOUT=10``: every rank raises within the timeout + 20 s, and exits.
18. ``clean_exit``: a sharded forward over the N ranks, then every rank exits as a script
    does (no ``os._exit``): torchrun must be gone within 20 s of the last result.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_check as one  # noqa: E402  (the one-GPU script: models, units, device memory, shared steps)
import gpu_check_lib as lib  # noqa: E402

SIZES_MIB = (1, 16, 64, 256)
AGREE_OFF_SIZES_MIB = (64, 256)
BW_GOAL, BW_FROM_MIB = 0.9, 64
DESYNC_TIMEOUT_S = 15.0  # HSDP_TIMEOUT for the desync steps: a hang ends there, not at 60 s
SUBGROUP_TIMEOUT_S = 10.0  # for timeout_subgroups
RAISE_MARGIN_S = 20.0  # every rank raises within its timeout and this
DRY_TIMEOUT_S = 3.0  # a dry run's HSDP_TIMEOUT for the steps that wait for one
BUDGET_S = 450  # the whole check stays under 8 minutes
# what a rank saw before hsdp's world existed (stray_contexts: a context on GPU 0 that torch alone
# made is torch's, not hsdp's)
BEFORE_HSDP: dict[str, Any] = {}


@dataclass
class Env(one.Env):
    """gpu_check.py's, with this rank's place in the world."""

    rank: int = 0
    size: int = 1


# ---------------------------------------------------------------------------- helpers
def bandwidths(total_bytes: int, seconds: float, ranks: int) -> dict[str, float]:
    """nccl-tests' numbers for an all-gather (NVIDIA/nccl-tests, doc/PERFORMANCE.md,
    "AllGather"): S is the size of the whole gathered array (sendcount * sizeof(type) * n),
    algbw = S / t, and busbw = algbw * (n - 1) / n, since each rank receives the n - 1
    chunks it does not hold. In GB/s (1e9 bytes), as nccl-tests prints them."""
    algbw = total_bytes / seconds / 1e9
    return {"algbw_GBps": algbw, "busbw_GBps": algbw * (ranks - 1) / ranks}


def mesh_kind(env: Env) -> str:
    """The device type hsdp's meshes over this world have ('cuda'; the fake's host view: 'cpu')."""
    from hsdp.world.mesh import device_type_of

    return device_type_of(env.world)


def same_on_every_rank(env: Env, data: bytes) -> bool:
    """Whether every rank of the world holds these bytes (16 bytes of their sha256 gathered)."""
    import numpy as np

    digest = np.frombuffer(hashlib.sha256(data).digest()[:16], np.uint8)
    every = np.zeros(16 * env.size, np.uint8)
    env.world.all_gather(digest.copy(), every)
    return all(bytes(every[16 * q:16 * q + 16]) == digest.tobytes() for q in range(env.size))


def members(group: Any, world_rank: int) -> list[int]:
    """The world ranks of a group, in its order (a host all-gather on it)."""
    import numpy as np

    out = np.full(group.size, -1, np.int32)
    group.all_gather(np.array([world_rank], np.int32), out)
    return out.tolist()


# ---------------------------------------------------------------------------- the steps
def step_split_ranks(env: Env) -> dict:
    w, r, n = env.world, env.world.rank, env.world.size
    parity = [q for q in range(n) if q % 2 == r % 2]
    # (label, color, key, the rank and size expected, the world ranks in the subgroup's order)
    cases = [("one_color_by_rank", 0, r, r, n, list(range(n))),
             ("one_color_reversed", 0, n - 1 - r, n - 1 - r, n, list(range(n - 1, -1, -1))),
             ("by_parity", r % 2, r, r // 2, len(parity), parity)]
    res: dict[str, Any] = {}
    block = 4160 if env.dry else 65536 + 4160
    for i, (label, color, key, want_rank, want_size, order) in enumerate(cases):
        sub = w.split(color, key)
        got = {"rank": sub.rank, "size": sub.size, "members": members(sub, r)}
        sub.barrier()
        dev = one.device_collectives(env, sub, block, 10 * i)
        res[label] = {**got, **dev, "ok": got == {"rank": want_rank, "size": want_size, "members": order}
                      and all(dev.values())}
    ok = all(v["ok"] for v in res.values())
    res["figure"] = f"{sum(v['ok'] for v in res.values())}/{len(cases)} splits exact"
    return {**res, "verdict": "PASS" if ok else "FAIL",
            "why": "each rank's place in every split, a gather in its order, all_gather_device and sendrecv on it"}


def mesh_shapes(n: int) -> list[tuple[int, int]]:
    return [(1, n), (n, 1)] + ([(2, n // 2)] if n % 2 == 0 and n >= 4 else [])


def step_mesh(env: Env) -> dict:
    import hsdp

    res: dict[str, Any] = {}
    for shape in mesh_shapes(env.size):
        mesh = hsdp.init_device_mesh(mesh_kind(env), shape)
        for g in (mesh.shard_group, mesh.replicate_group):
            g.barrier()
        u, want = one._unit(env, f"mesh.{shape}", 4160 * mesh.shard_group.size, 3, group=mesh.shard_group)
        exact = [one.gather_exact(env, u, want) for _ in range(2)]
        res[f"{shape[0]}x{shape[1]}"] = {
            "shard": [mesh.shard_group.rank, mesh.shard_group.size],
            "replicate": [mesh.replicate_group.rank, mesh.replicate_group.size], "exact": exact,
            "ok": all(exact) and (mesh.replicate_group.size, mesh.shard_group.size) == shape}
    ok = all(v["ok"] for v in res.values())
    res["figure"] = f"{sum(v['ok'] for v in res.values())}/{len(res)} meshes"
    return {**res, "verdict": "PASS" if ok else "FAIL",
            "why": "init_device_mesh: a barrier on both groups and a unit gather on the shard group"}


def step_inplace_offsets(env: Env) -> dict:
    import numpy as np

    from hsdp import _C

    w, r, n = env.world, env.world.rank, env.world.size
    sub = w.split(0, n - 1 - r)
    params = [np.arange(1001, dtype=np.float32) * 0.25 + 1, (np.arange(333, dtype=np.uint16) * 7 + 3),
              (np.arange(77, dtype=np.uint16) * 5 + 1).astype(np.uint8)]
    res: dict[str, Any] = {}
    for label, g in (("world", w), ("split_reversed", sub)):
        u = _C.Unit(g, ["float32", "bfloat16", "uint8"], [p.shape for p in params], name=f"offsets.{label}",
                    device="cuda")
        for i, p in enumerate(params):
            u.write(i, p, src_dtype="bfloat16" if i == 1 else None)  # bf16 as its raw bits
        rounds = []
        for _ in range(2):  # the first gather uploads this rank's chunk, the second reads it on the device
            u.unshard()
            full = one.gathered(env, u)
            u.reshard()
            rounds.append(all(full[o:o + p.nbytes] == p.tobytes() for o, p in zip(u.offsets, params, strict=True)))
        res[f"unit_{label}"] = {"rank": g.rank, "size": g.size, "chunk_bytes": u.chunk_bytes,
                                "total_bytes": u.total_bytes, "offsets": list(u.offsets), "exact": rounds,
                                "ok": all(rounds) and u.chunk_bytes * g.size == u.total_bytes}
        block = 4160  # bytes per rank: not a power of two
        mem = one.DeviceMemory(env)
        try:
            want = b"".join(one.pattern(block, q) for q in range(g.size))
            src = mem.alloc(one.pattern(block, g.rank))
            dst = mem.alloc(bytes(block * g.size))
            g.all_gather_device(src, dst, block, mem.stream)
            separate = mem.read(dst, len(want)) == want
            dst2 = mem.alloc(bytes(block * g.rank) + one.pattern(block, g.rank) + bytes(block * (g.size - g.rank - 1)))
            g.all_gather_device(dst2 + g.rank * block, dst2, block, mem.stream)  # NCCL's in-place form
            in_place = mem.read(dst2, len(want)) == want
        finally:
            mem.close()
        res[f"device_{label}"] = {"from_separate_source": separate, "in_place": in_place, "ok": separate and in_place}
    ok = all(v["ok"] for v in res.values())
    res["figure"] = "exact" if ok else "differs"
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": "every rank's bytes at their offsets, bit for bit"}


def _allgather_bw(env: Env, sizes: tuple[int, ...]) -> dict:
    """Each size S gathered four ways (CUDA events around `reps` calls, medians of three
    interleaved rounds): an hsdp unit, two hsdp units in flight at once (the time per gather),
    hsdp's all_gather_device, and torch.distributed's all_gather_into_tensor."""
    import numpy as np
    import torch.distributed as dist

    from hsdp import _C

    torch, n = env.torch, env.size
    stream = torch.cuda.current_stream()
    rows, exact = [], True
    for mib in sizes:
        total = (mib << 20) // (64 * n) * (64 * n)  # hsdp pads a unit to 64 bytes a rank
        block = total // n
        data = np.resize(np.frombuffer(one.pattern(1 << 16, mib), np.uint8), total)
        units = []
        for i in range(2):
            u = _C.Unit(env.world, ["uint8"], [(total,)], name=f"bw.{mib}MiB.{i}", device="cuda")
            u.write(0, data)
            u.unshard()  # uploads the shard; its bytes are checked on the GPU
            got = torch.from_dlpack(u.buffers()[0])[:total]
            exact = exact and bool(torch.equal(got, torch.from_numpy(data).to("cuda")))
            del got
            u.reshard()
            units.append(u)
        src = torch.full((block,), env.rank, dtype=torch.uint8, device="cuda")
        dst = torch.empty(total, dtype=torch.uint8, device="cuda")
        out = torch.empty_like(dst)

        def unit_gather(u: Any = units[0]) -> None:
            u.start_unshard()
            u.wait()
            u.reshard()

        def two_in_flight(a: Any = units[0], b: Any = units[1]) -> None:
            a.start_unshard()
            b.start_unshard()
            a.wait()
            b.wait()
            a.reshard()
            b.reshard()

        ways: dict[str, tuple[Callable[[], Any], int]] = {  # the call, and the gathers it makes
            "hsdp_unit": (unit_gather, 1),
            "hsdp_unit_2_in_flight": (two_in_flight, 2),
            "hsdp_all_gather_device": (lambda s=src, d=dst: env.world.all_gather_device(
                s.data_ptr(), d.data_ptr(), s.numel(), stream.cuda_stream), 1),
            "torch_all_gather_into_tensor": (lambda o=out, s=src: dist.all_gather_into_tensor(o, s), 1),
        }
        reps = 20 if mib < 64 else 10
        for fn, _ in ways.values():  # warm: buffers pooled, communicators connected
            for _ in range(3):
                fn()
        one.sync(env)
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(3):  # interleaved rounds
            for k, (fn, per) in ways.items():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                for _ in range(reps):
                    fn()
                b.record(stream)
                torch.cuda.synchronize()
                times[k].append(a.elapsed_time(b) / 1e3 / (reps * per))
        row: dict[str, Any] = {"S_bytes": total, "ranks": n}
        for way, ts in times.items():
            t = statistics.median(ts)
            row[way] = {"ms": t * 1e3, **bandwidths(total, t, n)}
        for name, got_all in (("hsdp_all_gather_device", dst), ("torch_all_gather_into_tensor", out)):
            row[name]["bytes_exact"] = all(bool((got_all[q * block:(q + 1) * block] == q).all()) for q in range(n))
            exact = exact and row[name]["bytes_exact"]
        ref = row["torch_all_gather_into_tensor"]["busbw_GBps"]
        for way in ("hsdp_unit", "hsdp_unit_2_in_flight", "hsdp_all_gather_device"):
            row[f"{way}_over_torch_busbw"] = row[way]["busbw_GBps"] / ref
        rows.append(row)
        del units, src, dst, out
        one.sync(env)
    big = [r for r in rows if r["S_bytes"] >= (BW_FROM_MIB << 20) // (64 * n) * (64 * n)]
    last = rows[-1]
    ratio, two = last["hsdp_unit_over_torch_busbw"], last["hsdp_unit_2_in_flight_over_torch_busbw"]
    return {"bytes_exact": exact, "rows": rows, "big": big,
            "figure": f"{ratio:.2f} (2 in flight {two:.2f}) @{sizes[-1]}MiB"}


def step_allgather_bw(env: Env) -> dict:
    res = _allgather_bw(env, SIZES_MIB)
    big = res.pop("big")
    fast = all(r["hsdp_unit_over_torch_busbw"] >= BW_GOAL for r in big)
    return {**res, "verdict": "PASS" if res["bytes_exact"] and fast else "FAIL",
            "why": f"hsdp's unit gather against torch's all_gather_into_tensor: busbw ratio goal {BW_GOAL} from "
                   f"{BW_FROM_MIB} MiB; all exact (figure: the unit's ratio, and with two units in flight)"}


def step_allgather_bw_agree_off(env: Env) -> dict:
    from hsdp import _C

    _C._set_agreement_check(False)  # every rank, before any gather: the tickets are off on all of them
    res = _allgather_bw(env, AGREE_OFF_SIZES_MIB)
    big = res.pop("big")
    fast = all(max(r["hsdp_unit_over_torch_busbw"], r["hsdp_unit_2_in_flight_over_torch_busbw"]) >= BW_GOAL
               for r in big)
    return {**res, "verdict": "PASS" if res["bytes_exact"] and fast else "FAIL",
            "why": f"the unit gather with the agreement tickets off (HSDP_AGREE_OFF): the bandwidth without their "
                   f"host waits; goal {BW_GOAL} of torch's busbw, one or two in flight"}


def _parity_everywhere(env: Env, model: Any, ref: Any, args: tuple, kw: dict[str, Any],
                       pick: Callable[[Any], Any]) -> dict:
    import hsdp

    res = one._parity(env, model, ref, args, kw, pick)
    torch = env.torch
    with torch.no_grad():
        out = pick(model(*args, **kw)).float().cpu().numpy().tobytes()
    res["same_output_on_every_rank"] = same_on_every_rank(env, out)
    res["sharded_over_all_ranks"] = all(st.unit.chunk_bytes * env.size == st.unit.total_bytes
                                        for st in hsdp.get_units(model))
    res["ok"] = res["bit_exact"] and res["same_output_on_every_rank"] and res["sharded_over_all_ranks"]
    return res


def step_parity_bf16(env: Env) -> dict:
    model, ref = one.sharded_pair(env, env.blocks)
    res = _parity_everywhere(env, model, ref, (one.block_inputs(env, env.blocks),), {}, lambda out: out)
    why = f"the block model sharded over {env.size} ranks against unsharded, bit for bit on every rank"
    if env.dry:
        return {**res, "verdict": one.dry_verdict(res["ok"]), "why": why + " (the fake's host view, CPU)"}
    return {**res, "verdict": "PASS" if res["ok"] else "FAIL", "why": why}


def step_parity_wan(env: Env) -> dict:
    one.require_diffusers()
    from hsdp.adapters.torch import unsharded_reference

    torch = env.torch
    cfg = one.WAN_TINY if env.dry else one.WAN
    args, kw = one._wan_inputs(env, cfg)
    ref = unsharded_reference(one._wan(torch, cfg), "bfloat16").to(env.target)
    model = one.shard(env, one._wan(torch, cfg))
    res = _parity_everywhere(env, model, ref, args, kw, lambda out: out[0])
    del ref
    one.sync(env)
    fp8 = one.shard(env, one._wan(torch, cfg), wire="float8_e4m3fn")
    with torch.no_grad():
        want = model(*args, **kw)[0].float()
        got = fp8(*args, **kw)[0].float()
    res["fp8_wire_rel_l2"] = float((got - want).norm() / want.norm())
    ok = res["ok"] and res["fp8_wire_rel_l2"] <= 0.05
    res["figure"] = f"{res['figure']}; fp8 {res['fp8_wire_rel_l2']:.3g}"
    why = f"the stock Wan over {env.size} ranks: bf16 bit for bit on every rank; the float8 wire within 0.05"
    if env.dry:
        return {**res, "verdict": one.dry_verdict(ok), "why": why + " (a tiny Wan on the fake's host view)"}
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": why}


def step_overlap(env: Env) -> dict:
    return one.step_overlap(env)  # over N ranks the next block's gather is NCCL's


def _ring(env: Env, g: Any, block: int, seed: int) -> dict[str, Any]:
    """N - 1 passes around g's ring by sendrecv_start_device (rank r sends what it holds to r + 1
    and receives from r - 1, into the other of two buffers): pass k brings rank r - k - 1's block."""
    r, n = g.rank, g.size
    mem = one.DeviceMemory(env)
    try:
        bufs = [mem.alloc(one.pattern(block, seed + r)), mem.alloc(bytes(block))]
        exact, ms = [], []
        for k in range(max(n - 1, 1)):
            cur, nxt = bufs[k % 2], bufs[(k + 1) % 2]
            t0 = time.perf_counter()
            g.sendrecv_start_device(cur, (r + 1) % n, nxt, (r - 1) % n, block)
            g.sendrecv_wait()  # the compute stream waits for it; read() synchronizes
            got = mem.read(nxt, block)
            ms.append((time.perf_counter() - t0) * 1e3)
            exact.append(got == one.pattern(block, seed + (r - k - 1) % n))
    finally:
        mem.close()
    return {"size": n, "passes": len(exact), "exact": exact, "ms_per_pass_host": statistics.median(ms),
            "ok": all(exact)}


def step_ring_sendrecv(env: Env) -> dict:
    w, r, n = env.world, env.world.rank, env.world.size
    block = 65536 + 4160 if env.dry else (8 << 20) + 4160
    res: dict[str, Any] = {"block_bytes": block, "world": _ring(env, w, block, 100)}
    res["split_reversed"] = _ring(env, w.split(0, n - 1 - r), block, 200)
    ok = res["world"]["ok"] and res["split_reversed"]["ok"]
    res["figure"] = ("exact" if ok else "differs") + f", {res['world']['ms_per_pass_host']:.2f} ms/pass"
    return {**res, "verdict": "PASS" if ok else "FAIL",
            "why": "sendrecv_start_device around the ring (world, reversed split): every block exact"}


def _a2a(env: Env, g: Any, block: int, seed: int) -> bool:
    """all_to_all_device on g: block j of rank i's send arrives as block i of rank j's receive."""
    r, n = g.rank, g.size
    mem = one.DeviceMemory(env)
    try:
        send = b"".join(one.pattern(block, seed + r * n + j) for j in range(n))
        want = b"".join(one.pattern(block, seed + i * n + r) for i in range(n))
        s, d = mem.alloc(send), mem.alloc(bytes(len(send)))
        g.all_to_all_device(s, d, block, mem.stream)
        return mem.read(d, len(want)) == want
    finally:
        mem.close()


def step_ulysses_a2a(env: Env) -> dict:
    w, r = env.world, env.world.rank
    block = 16384 if env.dry else (4 << 20) + 4160
    pairs = w.split(r // 2, r % 2)  # Ulysses groups of 2 (an odd world's last rank alone)
    res: dict[str, Any] = {"block_bytes": block, "world": _a2a(env, w, block, 1000),
                           "pairs": _a2a(env, pairs, block, 2000), "pairs_size": pairs.size}
    ok = res["world"] and res["pairs"]
    res["figure"] = "exact" if ok else "differs"
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": "all_to_all_device over the world and over pairs"}


def step_cfg_gather(env: Env) -> dict:
    import numpy as np

    w, r, n = env.world, env.world.rank, env.world.size
    half = n // 2
    # DiffusionParallelConfig's CFG layout (cfg_parallel_size=2): branch r // half, partner r +- half
    color, key = (r % half, r // half) if n % 2 == 0 else (r // 2, r % 2)
    cfg = w.split(color, key)
    order = members(cfg, r)
    block = 65536 + 4160 if env.dry else (1 << 20) + 4160
    mem = one.DeviceMemory(env)
    try:
        src, dst = mem.alloc(one.pattern(block, 500 + r)), mem.alloc(bytes(block * cfg.size))
        cfg.all_gather_device(src, dst, block, mem.stream)
        device = mem.read(dst, block * cfg.size) == b"".join(one.pattern(block, 500 + q) for q in order)
    finally:
        mem.close()
    host_out = np.zeros(4 * cfg.size, np.int32)
    cfg.all_gather(np.full(4, r, np.int32), host_out)
    host = host_out.tolist() == [q for q in order for _ in range(4)]
    res = {"cfg_group": order, "all_gather_device": device, "host_all_gather": host}
    ok = device and host and (cfg.size == 2 or n % 2 == 1)
    return {**res, "figure": f"{'exact' if ok else 'differs'} on {order}", "verdict": "PASS" if ok else "FAIL",
            "why": "the CFG split into groups of 2: all_gather_device and host all_gather, exact"}


def step_wire_fp8(env: Env) -> dict:
    from hsdp import _C
    from hsdp.world import nccl

    if not env.dry:
        nccl.load_wire_kernel()  # the dry run's ranks inherit the fake's, loaded before the fork
    ref = one.wire_unit(env.world, "host")  # the host decode, over the same world and layout
    ref.unshard()
    want = ctypes.string_at(ref.buffers()[0].address, ref.total_bytes)
    ref.reshard()
    u = one.wire_unit(env.world, "cuda")
    same = []
    for _ in range(2):  # the first gather encodes and uploads the shard, the second reads it there
        u.start_unshard()
        u.wait()
        got = one.gathered(env, u)
        same.append(got == want)
        u.reshard()
    res = {"bytes_equal_host": same, "same_on_every_rank": same_on_every_rank(env, got),
           "wire_chunk_bytes": u.wire_chunk_bytes, "chunk_bytes": u.chunk_bytes, "kernel_loaded": _C.wire_cuda_loaded()}
    ok = all(same) and res["same_on_every_rank"]
    res["figure"] = "bytes equal" if ok else "bytes differ"
    return {**res, "verdict": "PASS" if ok else "FAIL",
            "why": f"a device unit's float8 gather over {env.size} ranks == a host unit's, byte for byte, every rank"}


def primary_context_active(ordinal: int) -> bool | None:
    """Whether this process has the driver's primary context on device `ordinal` (the one the
    CUDA runtime makes), by cuDevicePrimaryCtxGetState; None when the driver cannot say."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if cu.cuInit(0) != 0 or cu.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return None
    if cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) != 0:
        return None
    return bool(active.value)


def compute_apps() -> tuple[dict[int, list[int]] | None, str]:
    """{GPU index: pids with a context there}, from nvidia-smi, else NVML (pynvml); (None, why)
    when neither answers."""
    if shutil.which("nvidia-smi"):
        rc1, gpus = lib.run_quiet(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"])
        rc2, apps = lib.run_quiet(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"])
        if rc1 == 0 and rc2 == 0:
            index = {u.strip(): int(i) for i, u in (line.split(",") for line in gpus.splitlines() if "," in line)}
            out: dict[int, list[int]] = {i: [] for i in index.values()}
            for line in apps.splitlines():
                if "," in line:
                    pid, uuid = line.split(",")
                    if uuid.strip() in index and pid.strip().isdigit():
                        out[index[uuid.strip()]].append(int(pid))
            return out, "nvidia-smi --query-compute-apps=pid,gpu_uuid"
    try:
        import pynvml

        pynvml.nvmlInit()
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out[i] = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
        return out, "NVML (pynvml)"
    except Exception as exc:  # no NVML either: the driver's own answer in each rank still stands
        return None, f"neither nvidia-smi nor NVML answered: {type(exc).__name__}: {exc}"[:300]


def step_stray_contexts(env: Env) -> dict:
    import numpy as np

    w, r, n = env.world, env.world.rank, env.world.size
    u, want = one._unit(env, "contexts", 4160 * n, 5)
    exact = [one.gather_exact(env, u, want) for _ in range(3)]
    w.barrier()
    time.sleep(1.0)  # hsdp's watchdog thread polls meanwhile: its CUDA calls must be on this rank's device
    on0: bool | None
    if env.dry:
        on0 = bool(env.fake.fake_contexts() & 1)  # the fake's: bit d, a context on device d in this process
    else:
        on0 = primary_context_active(0)
    res: dict[str, Any] = {"device": env.device, "pid": os.getpid(), "context_on_gpu0": on0, "gathers_exact": exact,
                           **BEFORE_HSDP}
    stray = bool(on0) and env.device != 0
    pids = np.zeros(n, np.int64)
    w.all_gather(np.array([os.getpid()], np.int64), pids)
    if r == 0 and not env.dry:  # while every rank is alive: between two barriers
        apps, how = compute_apps()
        res["listed_by"] = how
        if apps is not None:
            mine = {int(p): q for q, p in enumerate(pids)}
            listed = {q for procs in apps.values() for p in procs if p in mine for q in [mine[p]]}
            res["ranks_listed"] = sorted(listed)
            res["ranks_on_gpu0"] = sorted(mine[p] for p in apps.get(0, []) if p in mine)
            res["stray_listed"] = [q for q in res["ranks_on_gpu0"] if q != 0]
            stray = stray or bool(res["stray_listed"])
            if not listed:
                res["note"] = ("the tool lists none of this job's pids (another PID namespace?): the driver's "
                               "answer stands")
    w.barrier()
    ok = all(exact) and not stray  # a driver that cannot say (None) leaves the listing's answer
    res["figure"] = f"GPU 0 context: {'yes' if on0 else 'no' if on0 is not None else '?'} (device {env.device})"
    why = "no rank but those on GPU 0 has a context there (the watchdog thread included)"
    if stray and BEFORE_HSDP.get("context_on_gpu0_before_hsdp"):
        why += "; this rank had it before hsdp's world existed: torch made it"
    if env.dry:
        return {**res, "verdict": one.dry_verdict(ok), "why": why + " (the fake's per-thread contexts); the driver "
                                                                    "and nvidia-smi need GPUs"}
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": why}


def _desync(env: Env, same_size: bool) -> dict:
    import numpy as np

    from hsdp import _C

    w, r, n = env.world, env.world.rank, env.world.size
    per_rank = 4096
    sizes = (per_rank * n, per_rank * n if same_size else 2 * per_rank * n)
    units = []
    for i, size in enumerate(sizes):  # made in the same order everywhere: the units agree, the gathers not
        u = _C.Unit(w, ["uint8"], [(size,)], name=f"desync.{'ab'[i]}", device="cuda")
        u.write(0, np.frombuffer(one.pattern(size, i + 1), np.uint8))
        units.append(u)
    mine = units[r % 2]
    want = one.pattern(sizes[r % 2], r % 2 + 1)
    res: dict[str, Any] = {"unit": f"desync.{'ab'[r % 2]}", "bytes": sizes[r % 2]}
    # where the error may come: in the gather (its agreement tickets waited for there), or at
    # the next sync point if the tickets are checked later; never not at all
    stages: list[tuple[str, Callable[[], Any]]] = [
        ("gather", lambda: (mine.unshard(), res.update(weights_exact=one.gathered(env, mine) == want))),
        ("reshard", mine.reshard), ("next barrier", w.barrier)]
    t0 = time.monotonic()
    for stage, call in stages:
        try:
            call()
        except RuntimeError as exc:
            res.update(raised_at=stage, raised=f"{exc}"[:400], unsharded=mine.is_unsharded)
            break
    secs = time.monotonic() - t0
    res["seconds_to_raise"] = round(secs, 2)
    if "raised" not in res:
        res["figure"] = "no error"
        return {**res, "verdict": "FAIL",
                "why": "a rank went through a gather its peers did not make, its reshard and a barrier with no "
                       "error: the agreement ticket that rides with every NCCL unit gather did not catch it "
                       "(docs/design.md, '[Note: agreement]')"}
    ok = res["raised_at"] != "gather" or not mine.is_unsharded
    res["figure"] = f"raised at {res['raised_at']}, {secs:.1f} s"
    why = f"the desynced gather raised on this rank ({res['raised_at']})"
    if not ok:
        why = "the desynced gather raised but left the unit unsharded"
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": why}


def step_desync_same_size(env: Env) -> dict:
    return _desync(env, True)


def step_desync_sizes(env: Env) -> dict:
    return _desync(env, False)


def step_timeout_subgroups(env: Env) -> dict:
    import hsdp
    from hsdp import _C

    w, r, n = env.world, env.world.rank, env.world.size
    if n % 2 == 0 and n >= 4:
        shape = (2, n // 2)
        mesh = hsdp.init_device_mesh(mesh_kind(env), shape)
        shard, rep = mesh.shard_group, mesh.replicate_group
    else:  # a (1, N) mesh's shard group is the world itself: split off subgroups of our own
        shape = (1, n)
        low = r < max(2, n - 1)
        shard = w.split(color=0 if low else 1, key=r)  # ranks 0..N-2 (both of 2), and the last
        rep = w.split(color=0, key=n - 1 - r)  # every rank, in reverse: a second live communicator
    u, want = one._unit(env, "subgroups", 4160 * shard.size, 4, group=shard)
    first = one.gather_exact(env, u, want)  # every group connected and alive
    w.barrier()
    rep.barrier()
    timeout = float(_C.get_timeout())
    skipper = shard.size - 1  # world rank S - 1: the last rank of the first shard group
    res: dict[str, Any] = {"mesh": list(shape), "first_gather_exact": first, "timeout_s": timeout,
                           "skips": r == skipper}
    t0 = time.monotonic()
    raised: list[str] = []
    calls = [("world barrier", w.barrier)] if r == skipper else \
        [("shard-group gather", lambda: (u.unshard(), u.reshard())), ("world barrier", w.barrier)]
    if r == skipper:
        time.sleep(0.5)  # its peers are in the gather it skips; then it waits for them in the world
    for what, call in calls:  # the gather may return (its tickets checked later): the barrier raises then
        try:
            call()
        except RuntimeError as exc:
            raised.append(f"{what}: {exc}"[:400])
            break
    secs = time.monotonic() - t0
    res.update(raised=raised, seconds_to_raise=round(secs, 2))
    ok = first and bool(raised) and secs <= timeout + RAISE_MARGIN_S
    res["figure"] = f"raised in {secs:.1f} s" if raised else "no error"
    why = (f"one rank skips a shard-group gather: every rank raises within HSDP_TIMEOUT ({timeout:g} s) + "
           f"{RAISE_MARGIN_S:g} s")
    if env.dry:
        return {**res, "verdict": one.dry_verdict(ok), "why": why + "; a process's exit after it needs real processes"}
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": why + ", and its process exits"}


def step_clean_exit(env: Env) -> dict:
    import atexit

    model, ref = one.sharded_pair(env, one.SMALL_BLOCKS)
    res: dict[str, Any] = one.close_forward(env, model, ref, one.block_inputs(env, one.SMALL_BLOCKS))
    ok = res["model_close"]
    env.world.barrier()
    one.sync(env)
    if env.dry:  # a forked rank cannot exit as a script does: the teardown the exit would run, timed
        t0 = time.monotonic()
        atexit._run_exitfuncs()
        res["teardown_s"] = round(time.monotonic() - t0, 2)
        return {**res, "figure": f"teardown {res['teardown_s']} s", "verdict": one.dry_verdict(ok),
                "why": "a sharded forward, then the exit's teardown (atexit) on the fake; a process's exit needs "
                       "real processes"}
    return {**res, "verdict": "PASS" if ok else "FAIL",
            "why": "a sharded forward, then every rank exits as a script does (the check times it)"}


@dataclass(frozen=True)
class Step:
    name: str
    fn: Callable[[Env], dict]
    limit_s: int  # on GPUs
    gpu_only: str | None = None  # why a dry run cannot run it at all
    host_view: bool = False  # a dry run runs it under FAKE_HOST_VIEW=1 (torch models on the CPU)
    timeout_s: float | None = None  # its HSDP_TIMEOUT on GPUs (a dry run: DRY_TIMEOUT_S)
    normal_exit: bool = False  # its ranks exit as a script does; the check times their exit


STEPS: list[Step] = [
    Step("split_ranks", step_split_ranks, 90),
    Step("mesh", step_mesh, 90, host_view=True),
    Step("inplace_offsets", step_inplace_offsets, 90),
    Step("allgather_bw", step_allgather_bw, 150, gpu_only="bandwidth on real devices, and torch.distributed's NCCL"),
    Step("allgather_bw_agree_off", step_allgather_bw_agree_off, 100, gpu_only="bandwidth on real devices"),
    Step("parity_bf16", step_parity_bf16, 120, host_view=True),
    Step("parity_wan", step_parity_wan, 200, host_view=True),
    Step("overlap", step_overlap, 120, host_view=True),
    Step("ring_sendrecv", step_ring_sendrecv, 90),
    Step("ulysses_a2a", step_ulysses_a2a, 90),
    Step("cfg_gather", step_cfg_gather, 90),
    Step("wire_fp8", step_wire_fp8, 90),
    Step("stray_contexts", step_stray_contexts, 90),
    Step("desync_same_size", step_desync_same_size, 90, timeout_s=DESYNC_TIMEOUT_S),
    Step("desync_sizes", step_desync_sizes, 90, timeout_s=DESYNC_TIMEOUT_S),
    Step("timeout_subgroups", step_timeout_subgroups, 90, host_view=True, timeout_s=SUBGROUP_TIMEOUT_S,
         normal_exit=True),
    Step("clean_exit", step_clean_exit, 90, host_view=True, normal_exit=True),
]
STEP = {s.name: s for s in STEPS}


# ---------------------------------------------------------------------------- the ranks
def rank_result(out_dir: Path, step: str, rank: int, res: dict[str, Any]) -> None:
    res.update(rank=rank, pid=os.getpid(), written=time.time())
    lib.write_json(out_dir / f"{step}.rank{rank}.json", res)
    sys.stdout.flush(), sys.stderr.flush()


def gpu_worker(name: str, out_dir: Path, limit: float) -> int:
    """One rank under torchrun: join, run one step, write its result; then out (os._exit, but
    for the steps that test the exit itself)."""
    lib.worker_prelude(name, limit)
    step = STEP[name]
    rank = int(os.environ["RANK"])

    def run() -> dict:
        import torch

        import hsdp
        from hsdp import _C
        from hsdp.world import nccl

        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        if name == "stray_contexts":  # torch alone, before hsdp: whose is a context on GPU 0?
            torch.zeros(1, device="cuda")
            BEFORE_HSDP["context_on_gpu0_before_hsdp"] = primary_context_active(0)
        if step.timeout_s is not None:
            _C.set_timeout(step.timeout_s)
        if name.startswith("allgather_bw"):  # the reference: torch's own NCCL communicator of the same ranks
            import torch.distributed as dist

            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        world = hsdp.distributed.init_process_group("nccl")
        handle = ctypes.CDLL(nccl.library_paths()[1])
        handle.cudaGetLastError.restype = ctypes.c_int
        env = Env(dry=False, host_view=False, torch=torch, world=world, rank=world.rank, size=world.size,
                  device=local, cudart=handle)
        return step.fn(env)

    rank_result(out_dir, name, rank, lib.run_step_fn(run))  # no synchronize after: a desync may leave a stream stuck
    if step.normal_exit:
        return 0
    os._exit(0)


def _adopt_world(world: Any) -> None:
    """A dry run's forked rank joined the fake's world directly (its unique id came by fork):
    hsdp's API takes it as the world init_process_group would have made, as
    tests/nccl_torch_fake.py does (hsdp.world.distributed keeps it in _world)."""
    from hsdp.world import distributed

    distributed._world = world
    distributed.register_teardown()


def dry_rank(uid: bytes, rank: int, n: int, step: Step, fake: Path, out_dir: Path) -> None:
    """One forked rank of a dry run: join the fake's world, run one step, write its result."""
    from hsdp import _C

    def run() -> dict:
        _C.set_timeout(DRY_TIMEOUT_S)
        _C.nccl_bootstrap(uid, rank, n, rank % 2)  # the fake has 2 devices
        handle = ctypes.CDLL(str(fake))  # the handle the backend opened
        handle.cudaGetLastError.restype = ctypes.c_int
        world = _C.ProcessGroup("nccl")
        _adopt_world(world)
        torch = __import__("torch") if step.host_view else None  # the dry-step process imported it
        env = Env(dry=True, host_view=step.host_view, torch=torch, world=world, rank=rank, size=n, device=rank % 2,
                  cudart=handle, fake=handle)
        return step.fn(env)

    rank_result(out_dir, step.name, rank, lib.run_step_fn(run))
    os._exit(0)


def dry_step_main(name: str, n: int, fake: Path, out_dir: Path, limit: float) -> int:
    """A dry run's step: this process loads the fake and forks n ranks over a fresh unique id
    (a shared world of its own); each writes its result."""
    from hsdp import _C
    from hsdp.testing.forked import fork_ranks

    step = STEP[name]
    lib.worker_prelude(name, limit)
    _C.nccl_load(str(fake), str(fake))
    if name == "wire_fp8":
        _C.wire_cuda_load(str(fake), str(fake))  # the fake's NVRTC and driver; the ranks inherit it
    if step.host_view:
        __import__("torch")  # imported once, before the fork: each rank inherits it
    uid = _C.nccl_unique_id()
    codes, hung = fork_ranks(n, lambda r: dry_rank(uid, r, n, step, fake, out_dir), max(limit - 10, 5))
    print(f"{name}: " + (f"ranks {hung} killed (a hang)" if hung else f"exit statuses {codes}"), flush=True)
    return 0


# ---------------------------------------------------------------------------- the parent
def combine(per_rank: dict[int, dict | None], note: str) -> dict:
    """One verdict over the ranks: a rank without a result is an ERROR; else the worst rank's
    result, with what each rank had otherwise (the keys where it differs) under per_rank."""
    missing = [r for r, v in per_rank.items() if v is None]
    if missing:
        return {"verdict": "ERROR", "why": f"ranks {missing} gave no result ({note})"}
    res = [v for v in per_rank.values() if v is not None]
    order = ("ERROR", "TIMEOUT", "FAIL", "SKIPPED", "DRY", "PASS")
    head = min(res, key=lambda v: order.index(v["verdict"]))
    out = {k: v for k, v in head.items() if k not in ("rank", "pid", "written")}
    if head["verdict"] in ("ERROR", "TIMEOUT", "FAIL") and len(res) > 1:
        out["why"] = f"rank {head['rank']}: {head['why']}"
    out["per_rank"] = {v["rank"]: {k: x for k, x in v.items() if k in ("pid", "seconds") or head.get(k) != x}
                       for v in res}
    return out


def run_one(step: Step, n: int, dry: bool, fake: Path, out: Path, limit: float) -> dict[str, Any]:
    """A step's job (torchrun on GPUs, forked ranks in a dry run); its combined result."""
    for stale in out.glob(f"{step.name}.rank*.json"):
        stale.unlink()
    files = [out / f"{step.name}.rank{r}.json" for r in range(n)]
    me = str(Path(__file__).resolve())
    if dry:
        cmd = [sys.executable, me, "--dry-step", step.name, "--nproc", str(n), "--fake", str(fake),
               "--out-dir", str(out), "--limit", str(limit)]
        extra = {var: str(fake.resolve()) for var in ("HSDP_NCCL_LIBRARY", "HSDP_CUDART_LIBRARY", "HSDP_NVRTC_LIBRARY",
                                                      "HSDP_CUDA_DRIVER_LIBRARY")}
        extra["FAKE_HOST_VIEW"] = "1" if step.host_view else "0"
    else:
        # a rank starts a few seconds after its job (torchrun, imports): its traceback must come
        # before the parent's kill
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", me,
               "--worker", step.name, "--out-dir", str(out), "--limit", str(max(limit - 8, 6))]
        extra = {"OMP_NUM_THREADS": "1"}
    job = lib.run_job(cmd, lib.step_env(extra), limit, out / f"{step.name}.log",
                      lambda: all(f.is_file() for f in files))
    per_rank = {r: json.loads(f.read_text()) if f.is_file() else None for r, f in enumerate(files)}
    note = "killed at the step's limit (a hang)" if job.timed_out else f"the job ended with {job.rc}"
    res = combine(per_rank, note)
    if job.timed_out and res["verdict"] == "ERROR":
        res["verdict"] = "TIMEOUT"
    res["seconds"] = job.seconds
    res["job"] = {"rc": job.rc, "exit_after_results_s": job.exit_s, "log": str(job.log)}
    if step.normal_exit and not dry and res["verdict"] in ("PASS", "FAIL"):
        if job.exit_hung:
            res["verdict"], res["why"] = "FAIL", (f"{res['why']}; but the ranks did not exit within "
                                                  f"{lib.EXIT_GRACE_S:.0f} s of their results: killed")
        elif job.rc != 0:
            res["verdict"], res["why"] = "FAIL", f"{res['why']}; but the job exited with status {job.rc}"
        else:
            res["figure"] = f"{res.get('figure', '-')}; exit {job.exit_s:.1f} s"
    if res["verdict"] in ("FAIL", "ERROR", "TIMEOUT"):
        res["log_tail"] = job.log_tail()
    return res


def step_preflight_process(report: lib.Report, dry: bool, fake: Path, out: Path) -> dict[str, Any]:
    """The versions, in a process of its own (the parent never touches the GPU)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import gpu_check_lib as lib; "
            "v = lib.versions(sys.argv[2] == '1'); "
            "rc, topo = lib.run_quiet(['nvidia-smi', 'topo', '-m']); v['topology'] = topo if rc == 0 else None; "
            "print('VERSIONS ' + json.dumps(v, default=str))")
    extra = {var: str(fake.resolve()) for var in ("HSDP_NCCL_LIBRARY", "HSDP_CUDART_LIBRARY", "HSDP_NVRTC_LIBRARY")} \
        if dry else {}
    log = out / "preflight.log"
    job = lib.run_job([sys.executable, "-c", code, str(HERE), "1" if dry else "0"], lib.step_env(extra),
                      min(60.0, report.left()), log, lambda: False)
    line = next((ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("VERSIONS ")), None)
    if line is None:
        return lib.died(job, "the preflight")
    v = json.loads(line[len("VERSIONS "):])
    gpus = v["gpus"]
    res: dict[str, Any] = {"versions": v, "seconds": job.seconds,
                           "figure": f"{len(gpus)} x {gpus[0]['name']}" if gpus else "no GPU"}
    if dry:
        return {**res, "verdict": "DRY", "why": "the versions of what is here; the fake stands in for the GPUs"}
    return {**res, "verdict": "PASS", "why": f"torch {v['torch']} (CUDA {v['torch_cuda']}), driver CUDA "
                                             f"{v['driver_cuda']}, {len(gpus)} GPUs, diffusers {v['diffusers']}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="fork ranks against the fake CUDA/NCCL library, no GPU")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (GPUs): default every visible GPU; 3 in a dry run")
    ap.add_argument("--fake", type=Path, default=lib.FAKE, help="the fake library for --dry-run (built when missing)")
    ap.add_argument("--step", action="append", choices=[s.name for s in STEPS], help="run only these steps")
    ap.add_argument("--json", type=Path,
                    help="the JSON file (default $OUT/gpu_check_multi.json, else a temporary folder)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check (default %(default)s)")
    ap.add_argument("--step-limit", type=float, help="at most this many seconds for any one step")
    ap.add_argument("--worker", choices=[s.name for s in STEPS], help=argparse.SUPPRESS)  # one rank, under torchrun
    ap.add_argument("--dry-step", choices=[s.name for s in STEPS], help=argparse.SUPPRESS)  # a dry run's step
    ap.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return gpu_worker(args.worker, args.out_dir, args.limit)
    if args.dry_step:
        return dry_step_main(args.dry_step, args.nproc, args.fake, args.out_dir, args.limit)
    if args.nproc < 0 or args.nproc == 1 or (args.dry_run and args.nproc > 8):
        ap.error(f"--nproc must be 2 or more (0: the default; at most 8 in a dry run), got {args.nproc}")
    path = lib.json_path("gpu_check_multi", args.json)
    out = path.parent / "gpu_check_multi"
    out.mkdir(parents=True, exist_ok=True)
    report = lib.Report("gpu_check_multi", path, "dry-run" if args.dry_run else "gpu", args.budget)
    mode = "dry run (forked ranks against the fake CUDA/NCCL, no GPU)" if args.dry_run else "GPUs"
    print(f"gpu_check_multi: {mode}; {sys.executable}; JSON {path}; per-rank results and logs in {out}", flush=True)
    built = lib.preflight(report, args.dry_run, args.fake, out)
    pre: dict[str, Any] = step_preflight_process(report, args.dry_run, args.fake, out) if built else \
        {"verdict": "ERROR", "why": "not run: hsdp is not built (see 'build')"}
    report.add("preflight", pre)
    count = len(pre.get("versions", {}).get("gpus", []))
    n = args.nproc or (3 if args.dry_run else count)
    short = not args.dry_run and (count < 2 or n > count)
    if short:
        print(f"gpu_check_multi: needs 2 or more GPUs and one per rank: {count} visible, {args.nproc or 'every one'} "
              f"asked for (bench/gpu_check.py is the check for one; --dry-run runs this one against the fake library)",
              file=sys.stderr)
    report.doc["ranks"] = n
    for step in STEPS:
        if args.step and step.name not in args.step:
            continue
        lib.crash_parent_before(step.name)
        left = report.left() - 5
        if not built:
            res: dict[str, Any] = {"verdict": "ERROR", "why": "not run: hsdp is not built (see 'build')"}
        elif short:
            res = {"verdict": "SKIPPED", "why": f"needs 2 or more GPUs ({count} visible)"}
        elif args.dry_run and step.gpu_only:
            res = {"verdict": "DRY", "why": f"needs a GPU: {step.gpu_only}"}
        elif left < 15:
            res = {"verdict": "TIMEOUT", "why": f"not run: the {args.budget:.0f} s budget is spent"}
        else:
            limit = min(60.0 if args.dry_run else step.limit_s, left, args.step_limit or left)
            res = run_one(step, n, args.dry_run, args.fake, out, limit)
        report.add(step.name, res)
    status = report.finish()
    return 2 if short else status


if __name__ == "__main__":
    sys.exit(main())
