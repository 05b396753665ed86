"""The first run of the NCCL backend on 2 or more GPUs of one host, step by step.

    python bench/gpu_check_multi.py             # N = every visible GPU (at least 2); under 8 minutes
    python bench/gpu_check_multi.py --nproc 2   # 2 processes on GPUs 0 and 1
    python bench/gpu_check_multi.py --dry-run   # without a GPU: 3 ranks against the fake library
                                                # (make csrc/tests/bin/fake_cuda_nccl.so builds it)

Every step is a job of its own: ``torchrun --standalone --nproc-per-node N`` started by this
script (the way docs/launching.md starts hsdp on GPUs; the unique id goes through torchrun's
store), so a rank that fails, hangs or aborts its communicator cannot spoil the steps after
it. A rank that gives no result within the step's time limit is killed, and the step says
so. A dry run forks its N ranks from one process instead (the fake's shared world is
inherited, as in ``test_nccl --fake ... ranks 3``). Each step ends in one verdict line,
combined over the ranks: PASS, FAIL, ERROR (a rank raised, or gave no result), or SKIPPED
("skipped: needs a GPU", and why) in a dry run.

1. ``allgather_bw``: the same gather at 1, 16, 64 and 256 MiB (the gathered size S) three
   ways: a unit through hsdp (``start_unshard``, ``wait``, ``reshard``), hsdp's device
   all-gather (``all_gather_device``) and torch.distributed's ``all_gather_into_tensor`` on a
   communicator of the same size (the plain ``ncclAllGather``). CUDA events, medians of
   interleaved rounds; algorithm and bus bandwidth by nccl-tests' formula. Goal: the hsdp
   unit's bus bandwidth at least 0.9 of torch's from 64 MiB up; the unit's bytes exact.
2. ``split_ranks``: splits of the world (one color by rank; one color by reversed key; by
   parity): each rank's rank and size in the subgroup, and a host all-gather there that lists
   the world ranks in the subgroup's order; then a barrier on each.
3. ``inplace_offsets``: a unit of three parameters of odd sizes (float32, bfloat16, uint8)
   gathered over the world and over a split with reversed ranks, twice (the first gather
   uploads, the second reads the device copy): every byte at its offset; and
   ``all_gather_device`` from a separate source and in place (source = receive buffer +
   rank * block): every rank's block where it belongs.
4. ``parity_bf16``: the stock diffusers Wan of gpu_check.py (1.3B-like blocks, 6 of them)
   sharded over the N GPUs in bf16 against the same weights unsharded on each GPU: bit for
   bit on every rank, and the same output on every rank.
5. ``desync_same_size`` and 6. ``desync_sizes``: even ranks unshard one unit, odd ranks
   another (of the same size; of different sizes). Goal: every rank raises RuntimeError in
   that gather, within ``HSDP_TIMEOUT`` (set to 15 s for them), and none returns weights.
   Every unit gather on NCCL carries its agreement ticket in the same NCCL group as its data
   (docs/design.md, "[Note: agreement]"), so the ranks fail together at the wait.

Exit status: 0 when no step failed or raised, 1 otherwise, 2 without enough GPUs (and
without ``--dry-run``). Per-rank results go to $OUT/gpu_check_multi/ when OUT is set
(gpu_check_multi.json: the verdicts), else to a temporary folder. Nothing here changes the
cards' settings. **Untested on a GPU**: none has been lent to this project yet; the dry run
is what has run.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_check as one  # noqa: E402  (the one-GPU script: the Wan, its inputs, the fake's helpers)

SIZES_MIB = (1, 16, 64, 256)
BW_GOAL, BW_FROM_MIB = 0.9, 64
DESYNC_TIMEOUT_S = 15.0  # HSDP_TIMEOUT for the desync steps: a hang ends there, not at 600 s
DRY_TIMEOUT_S = 3.0
BUDGET_S = 470  # the whole check stays under 8 minutes


@dataclass
class Env:
    dry: bool
    torch: Any
    world: Any
    rank: int
    size: int
    device: int
    cudart: Any  # ctypes handle of the libcudart hsdp opened (the fake in a dry run)


# ---------------------------------------------------------------------------- bandwidth
def bandwidths(total_bytes: int, seconds: float, ranks: int) -> dict[str, float]:
    """nccl-tests' numbers for an all-gather (NVIDIA/nccl-tests, doc/PERFORMANCE.md,
    "AllGather"): S is the size of the whole gathered array (sendcount * sizeof(type) * n),
    algbw = S / t, and busbw = algbw * (n - 1) / n, since each rank receives the n - 1
    chunks it does not hold. In GB/s (1e9 bytes), as nccl-tests prints them."""
    algbw = total_bytes / seconds / 1e9
    return {"algbw_GBps": algbw, "busbw_GBps": algbw * (ranks - 1) / ranks}


# ---------------------------------------------------------------------------- device memory
class DeviceMemory:
    """Device buffers for the byte checks: torch tensors on a GPU; in a dry run the fake's
    cudaMalloc (its device memory is host memory). Freed by close()."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.held: dict[int, Any] = {}  # address -> the tensor (GPU) or None (fake)
        self.stream = env.torch.cuda.current_stream().cuda_stream if not env.dry else one._fake_stream(env)

    def alloc(self, data: bytes) -> int:
        if self.env.dry:
            p = ctypes.c_void_p()
            if self.env.cudart.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(len(data))) != 0:
                raise RuntimeError("the fake could not allocate")
            ctypes.memmove(p.value, data, len(data))
            self.held[int(p.value)] = None
            return int(p.value)
        torch = self.env.torch
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to("cuda")
        self.held[t.data_ptr()] = t
        return t.data_ptr()

    def read(self, addr: int, n: int) -> bytes:
        """n bytes at addr once the work on this memory's stream is done."""
        if self.env.dry:
            self.env.cudart.cudaStreamSynchronize(ctypes.c_void_p(self.stream))
            return ctypes.string_at(addr, n)
        self.env.torch.cuda.synchronize()
        return self.held[addr][:n].cpu().numpy().tobytes()

    def close(self) -> None:
        if self.env.dry:
            self.env.cudart.cudaStreamSynchronize(ctypes.c_void_p(self.stream))
            for addr in self.held:
                self.env.cudart.cudaFree(ctypes.c_void_p(addr))
            self.env.cudart.cudaStreamDestroy(ctypes.c_void_p(self.stream))
        self.held.clear()


def gathered(env: Env, unit: Any) -> bytes:
    """The whole gathered buffer of an unsharded unit, as the compute stream sees it."""
    buf = unit.buffers()[0]
    if env.dry:
        env.cudart.cudaStreamSynchronize(None)  # the compute stream of the fake's world
        return ctypes.string_at(buf.address, buf.nbytes)
    t = env.torch.from_dlpack(buf)  # on the current stream, which hsdp's gathers order
    out = t.cpu().numpy().tobytes()
    del t
    return out


def pattern(n: int, seed: int) -> bytes:
    import numpy as np

    return ((np.arange(n, dtype=np.uint32) * 13 + seed * 101) % 251 + 1).astype(np.uint8).tobytes()


# ---------------------------------------------------------------------------- the steps
def step_allgather_bw(env: Env) -> dict:
    import numpy as np
    import torch.distributed as dist

    from hsdp import _C

    torch, n = env.torch, env.size
    stream = torch.cuda.current_stream()
    rows, exact = [], True
    for mib in SIZES_MIB:
        total = (mib << 20) // (64 * n) * (64 * n)  # hsdp pads a unit to 64 bytes a rank
        block = total // n
        data = np.frombuffer(pattern(1 << 16, mib) * (total >> 16) + pattern(total & 0xFFFF, mib), np.uint8)
        u = _C.Unit(env.world, ["uint8"], [(total,)], name=f"bw.{mib}MiB", device="cuda")
        u.write(0, data)
        u.unshard()  # uploads the shard; its bytes are checked on the GPU
        want = torch.from_numpy(data.copy()).to("cuda")
        got = torch.from_dlpack(u.buffers()[0])[:total]
        exact = exact and bool(torch.equal(got, want))
        del got, want
        u.reshard()
        src = torch.full((block,), env.rank, dtype=torch.uint8, device="cuda")
        dst = torch.empty(total, dtype=torch.uint8, device="cuda")
        out = torch.empty_like(dst)

        def unit_gather() -> None:
            u.start_unshard()
            u.wait()
            u.reshard()

        ways: dict[str, Callable[[], Any]] = {
            "hsdp_unit": unit_gather,
            "hsdp_all_gather_device": lambda: env.world.all_gather_device(src.data_ptr(), dst.data_ptr(), block,
                                                                          stream.cuda_stream),
            "torch_all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, src),
        }
        reps = 20 if mib < 64 else 10
        for fn in ways.values():  # warm: buffers pooled, communicators connected
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(3):  # interleaved rounds
            for k, fn in ways.items():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                for _ in range(reps):
                    fn()
                b.record(stream)
                torch.cuda.synchronize()
                times[k].append(a.elapsed_time(b) / 1e3 / reps)
        row: dict[str, Any] = {"S_bytes": total, "ranks": n}
        for k, ts in times.items():
            t = statistics.median(ts)
            row[k] = {"ms": t * 1e3, **bandwidths(total, t, n)}
        torch.cuda.synchronize()
        for name, got_all in (("hsdp_all_gather_device", dst), ("torch_all_gather_into_tensor", out)):
            row[name]["bytes_exact"] = all(bool((got_all[q * block:(q + 1) * block] == q).all()) for q in range(n))
            exact = exact and row[name]["bytes_exact"]
        ref = row["torch_all_gather_into_tensor"]["busbw_GBps"]
        row["unit_over_torch_busbw"] = row["hsdp_unit"]["busbw_GBps"] / ref
        row["device_over_torch_busbw"] = row["hsdp_all_gather_device"]["busbw_GBps"] / ref
        rows.append(row)
        del u, src, dst, out
    big = [r for r in rows if r["S_bytes"] >= (BW_FROM_MIB << 20) // (64 * n) * (64 * n)]
    fast = all(r["unit_over_torch_busbw"] >= BW_GOAL for r in big)
    res = {"bytes_exact": exact, "rows": rows}
    return {**res, "verdict": "PASS" if exact and fast else "FAIL",
            "why": f"hsdp's unit gather against torch's all_gather_into_tensor: busbw ratio goal {BW_GOAL} "
                   f"from {BW_FROM_MIB} MiB; all three exact"}


def step_split_ranks(env: Env) -> dict:
    import numpy as np

    w, r, n = env.world, env.world.rank, env.world.size
    parity = [q for q in range(n) if q % 2 == r % 2]
    # (label, color, key, the rank and size expected, the world ranks in the subgroup's order)
    cases = [("one_color_by_rank", 0, r, r, n, list(range(n)))]
    if not env.dry:
        cases += [("one_color_reversed", 0, n - 1 - r, n - 1 - r, n, list(range(n - 1, -1, -1))),
                  ("by_parity", r % 2, r, r // 2, len(parity), parity)]
    res: dict[str, Any] = {}
    for label, color, key, want_rank, want_size, members in cases:
        sub = w.split(color, key)
        out = np.full(sub.size, -1, np.int32)
        sub.all_gather(np.array([r], np.int32), out)
        sub.barrier()
        got = {"rank": sub.rank, "size": sub.size, "members": out.tolist()}
        res[label] = {**got, "ok": got == {"rank": want_rank, "size": want_size, "members": members}}
    ok = all(v["ok"] for v in res.values())
    why = "each rank's place in every split, and a gather in the split's order"
    if env.dry:
        why += "; reversed keys and several colors need a GPU (the fake splits into one color by rank)"
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": why}


def step_inplace_offsets(env: Env) -> dict:
    import numpy as np

    from hsdp import _C

    w, r, n = env.world, env.world.rank, env.world.size
    # the fake splits into one color by rank only: its split is the world again, a channel of its own
    sub = w.split(0, r) if env.dry else w.split(0, n - 1 - r)
    params = [np.arange(1001, dtype=np.float32) * 0.25 + 1, (np.arange(333, dtype=np.uint16) * 7 + 3),
              (np.arange(77, dtype=np.uint16) * 5 + 1).astype(np.uint8)]
    res: dict[str, Any] = {}
    for label, g in (("world", w), ("split_reversed" if not env.dry else "split", sub)):
        u = _C.Unit(g, ["float32", "bfloat16", "uint8"], [p.shape for p in params], name=f"offsets.{label}",
                    device="cuda")
        for i, p in enumerate(params):
            u.write(i, p, src_dtype="bfloat16" if i == 1 else None)  # bf16 as its raw bits
        rounds = []
        for _ in range(2):  # the first gather uploads this rank's chunk, the second reads it on the device
            u.unshard()
            full = gathered(env, u)
            u.reshard()
            rounds.append(all(full[o:o + p.nbytes] == p.tobytes() for o, p in zip(u.offsets, params)))
        res[f"unit_{label}"] = {"rank": g.rank, "size": g.size, "chunk_bytes": u.chunk_bytes,
                                "total_bytes": u.total_bytes, "offsets": list(u.offsets), "exact": rounds,
                                "ok": all(rounds) and u.chunk_bytes * g.size == u.total_bytes}
        block = 4160  # bytes per rank: not a power of two
        mem = DeviceMemory(env)
        try:
            want = b"".join(pattern(block, q) for q in range(g.size))
            src = mem.alloc(pattern(block, g.rank))
            dst = mem.alloc(bytes(block * g.size))
            g.all_gather_device(src, dst, block, mem.stream)
            separate = mem.read(dst, len(want)) == want
            dst2 = mem.alloc(bytes(block * g.rank) + pattern(block, g.rank) + bytes(block * (g.size - g.rank - 1)))
            g.all_gather_device(dst2 + g.rank * block, dst2, block, mem.stream)  # NCCL's in-place form
            in_place = mem.read(dst2, len(want)) == want
        finally:
            mem.close()
        res[f"device_{label}"] = {"from_separate_source": separate, "in_place": in_place, "ok": separate and in_place}
    ok = all(v["ok"] for v in res.values())
    return {**res, "verdict": "PASS" if ok else "FAIL", "why": "every rank's bytes at their offsets, bit for bit"}


def step_parity_bf16(env: Env) -> dict:
    import numpy as np

    import hsdp
    from hsdp.adapters.torch import unsharded_reference

    torch = env.torch
    ref = unsharded_reference(one._wan(torch), "bfloat16").to("cuda")
    model = one._sharded_wan(env)
    args, kw = one._inputs(torch)
    with torch.no_grad():
        want = ref(*args, **kw)[0]
        got = [model(*args, **kw)[0] for _ in range(3)]  # the first records the order, later ones prefetch
    torch.cuda.synchronize()
    exact = all(torch.equal(want, g) for g in got)
    units = [st.unit for st in hsdp.get_units(model)]
    sharded = all(u.chunk_bytes * env.size == u.total_bytes for u in units)
    digest = np.frombuffer(hashlib.sha256(got[-1].float().cpu().numpy().tobytes()).digest()[:16], np.uint8)
    every = np.zeros(16 * env.size, np.uint8)
    env.world.all_gather(digest.copy(), every)
    same = all(bytes(every[16 * q:16 * q + 16]) == digest.tobytes() for q in range(env.size))
    res = {"bit_exact": exact, "max_abs_diff": float((want.float() - got[-1].float()).abs().max()),
           "sharded_over_all_ranks": sharded, "same_output_on_every_rank": same,
           "gather_paths": sorted({u.gather_path for u in units})}
    ok = exact and sharded and same
    return {**res, "verdict": "PASS" if ok else "FAIL",
            "why": f"sharded over {env.size} GPUs against unsharded, bit for bit on every rank"}


def _desync(env: Env, same_size: bool) -> dict:
    import numpy as np

    from hsdp import _C

    w, r, n = env.world, env.world.rank, env.world.size
    per_rank = 4096
    sizes = (per_rank * n, per_rank * n if same_size else 2 * per_rank * n)
    units = []
    for i, size in enumerate(sizes):  # made in the same order everywhere: the units agree, the gathers not
        u = _C.Unit(w, ["uint8"], [(size,)], name=f"desync.{'ab'[i]}", device="cuda")
        u.write(0, np.frombuffer(pattern(size, i + 1), np.uint8))
        units.append(u)
    mine = units[r % 2]
    res: dict[str, Any] = {"unit": f"desync.{'ab'[r % 2]}", "bytes": sizes[r % 2]}
    t0 = time.monotonic()
    try:
        mine.unshard()
        full = gathered(env, mine)
    except RuntimeError as exc:
        res.update(raised=f"{exc}"[:400], seconds=round(time.monotonic() - t0, 2), unsharded=mine.is_unsharded)
        ok = not mine.is_unsharded
        return {**res, "verdict": "PASS" if ok else "FAIL", "why": "the desynced gather raised on this rank"}
    res.update(returned_after_s=round(time.monotonic() - t0, 2), weights_exact=full == pattern(sizes[r % 2], r % 2 + 1))
    mine.reshard()
    try:  # does the error come later, at least? (bounded by the timeout)
        w.barrier()
        res["next_barrier"] = "returned"
    except RuntimeError as exc:
        res["next_barrier"] = f"raised: {exc}"[:400]
    return {**res, "verdict": "FAIL",
            "why": "a rank returned from a gather its peers did not make, with no error: the agreement ticket "
                   "that rides with every NCCL unit gather did not catch it (docs/design.md, '[Note: agreement]')"}


def step_desync_same_size(env: Env) -> dict:
    return _desync(env, True)


def step_desync_sizes(env: Env) -> dict:
    return _desync(env, False)


# name, the step, its time limit on GPUs (s), why a dry run cannot run it (None: it can)
STEPS: list[tuple[str, Callable[[Env], dict], int, str | None]] = [
    ("allgather_bw", step_allgather_bw, 150, "bandwidth on real devices, and torch.distributed's NCCL"),
    ("split_ranks", step_split_ranks, 90, None),
    ("inplace_offsets", step_inplace_offsets, 90, None),
    ("parity_bf16", step_parity_bf16, 200, "a stock Wan in bf16 on torch's CUDA device"),
    ("desync_same_size", step_desync_same_size, 120, None),
    ("desync_sizes", step_desync_sizes, 120, None),
]


def run_step(fn: Callable[[Env], dict], env: Env) -> dict:
    t0 = time.time()
    try:
        res = fn(env)
    except Exception as exc:  # every rank reports, even after one raises
        res = {"verdict": "ERROR", "why": f"{type(exc).__name__}: {exc}"}
    res["rank"], res["seconds"] = env.rank, round(time.time() - t0, 2)
    return res


# ---------------------------------------------------------------------------- the ranks
def gpu_worker(step: str, out_dir: Path) -> None:
    """One rank under torchrun: join, run one step, write its result."""
    import torch

    import hsdp
    from hsdp import _C
    from hsdp.world import nccl

    rank = int(os.environ["RANK"])
    fn = next(f for name, f, _, _ in STEPS if name == step)
    try:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        if step.startswith("desync"):
            _C.set_timeout(DESYNC_TIMEOUT_S)
        if step == "allgather_bw":  # the reference: torch's own NCCL communicator of the same ranks
            import torch.distributed as dist

            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        world = hsdp.distributed.init_process_group("nccl")
        lib = ctypes.CDLL(nccl.library_paths()[1])
        env = Env(dry=False, torch=torch, world=world, rank=world.rank, size=world.size, device=local, cudart=lib)
        res = run_step(fn, env)  # no synchronize after: a desync may have left a stream stuck
    except Exception as exc:
        res = {"verdict": "ERROR", "why": f"setting up: {type(exc).__name__}: {exc}", "rank": rank}
    (out_dir / f"{step}.rank{rank}.json").write_text(json.dumps(res))
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # a communicator aborted by a desync need not be torn down


def launch_gpu(step: str, n: int, out_dir: Path, limit: float) -> str:
    """torchrun of n ranks for one step; returns what the launcher said when a rank gave no result."""
    log = out_dir / f"{step}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           str(Path(__file__).resolve()), "--worker", step, "--out-dir", str(out_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=limit)
            note = f"torchrun exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun and its ranks: the group this call started
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            note = f"killed after {limit:.0f} s (a hang)"
    tail = log.read_text(errors="replace")[-600:].strip().replace("\n", " | ")
    return f"{note}; log {log}: ...{tail}"


def dry_rank(uid: bytes, rank: int, n: int, step: str, fake: Path, out_dir: Path) -> None:
    """One forked rank of a dry run: join the fake's world, run one step, write its result."""
    from hsdp import _C

    fn = next(f for name, f, _, _ in STEPS if name == step)
    try:
        _C.set_timeout(DRY_TIMEOUT_S)
        _C.nccl_bootstrap(uid, rank, n, rank % 2)  # the fake has 2 devices
        lib = ctypes.CDLL(str(fake))  # the handle the backend opened
        world = _C.ProcessGroup("nccl")
        res = run_step(fn, Env(dry=True, torch=None, world=world, rank=rank, size=n, device=rank % 2, cudart=lib))
    except Exception as exc:
        res = {"verdict": "ERROR", "why": f"setting up: {type(exc).__name__}: {exc}", "rank": rank}
    (out_dir / f"{step}.rank{rank}.json").write_text(json.dumps(res))
    os._exit(0)


def launch_dry(step: str, n: int, fake: Path, out_dir: Path, limit: float) -> str:
    """n ranks forked from this process, each from a fresh unique id (a fresh shared world)."""
    from hsdp import _C

    from hsdp.testing.forked import fork_ranks

    uid = _C.nccl_unique_id()
    codes, hung = fork_ranks(n, lambda r: dry_rank(uid, r, n, step, fake, out_dir), limit)
    return f"ranks {hung} killed after {limit:.0f} s (a hang)" if hung else f"exit statuses {codes}"


def combine(per_rank: dict[int, dict | None], note: str) -> dict:
    """One verdict over the ranks: a rank without a result is an ERROR; else the worst."""
    missing = [r for r, v in per_rank.items() if v is None]
    if missing:
        return {"verdict": "ERROR", "why": f"ranks {missing} gave no result ({note})"}
    res = list(per_rank.values())
    for worst in ("ERROR", "FAIL", "SKIPPED"):
        bad = [v for v in res if v["verdict"] == worst]
        if bad:
            why = f"rank {bad[0]['rank']}: {bad[0]['why']}"
            # every rank's details; its reason only where it differs from the one reported
            detail = {v["rank"]: {k: x for k, x in v.items() if k != "rank" and (k != "why" or x != bad[0]["why"])}
                      for v in res}
            return {"verdict": worst, "why": why, "per_rank": detail}
    first = res[0]
    return {**{k: v for k, v in first.items() if k != "rank"},
            "seconds_per_rank": [v["seconds"] for v in res]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="fork ranks against the fake CUDA/NCCL library, no GPU")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (GPUs): default every visible GPU; 3 in a dry run")
    ap.add_argument("--fake", type=Path, default=one.FAKE, help="the fake library for --dry-run")
    ap.add_argument("--step", action="append", choices=[s[0] for s in STEPS], help="run only these steps")
    ap.add_argument("--worker", choices=[s[0] for s in STEPS], help=argparse.SUPPRESS)  # one rank, under torchrun
    ap.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        gpu_worker(args.worker, args.out_dir)
    if args.nproc < 0 or args.nproc == 1:
        ap.error(f"--nproc must be 2 or more (0: the default), got {args.nproc}")
    if args.dry_run:
        if not args.fake.is_file():
            raise FileNotFoundError(f"no fake CUDA/NCCL library at {args.fake}: build it with "
                                    f"'make csrc/tests/bin/fake_cuda_nccl.so'")
        from hsdp import _C

        n = args.nproc or 3
        if n > 8:
            ap.error(f"--nproc {n}: the fake's worlds hold at most 8 ranks")
        _C.nccl_load(str(args.fake), str(args.fake))
        mode = f"dry run: {n} forked ranks against the fake CUDA/NCCL (no GPU)"
    else:
        import torch

        count = torch.cuda.device_count()
        n = args.nproc or count
        if count < 2 or n > count:
            print(f"gpu_check_multi: needs 2 or more GPUs and one per rank: {count} visible, {args.nproc or 'every one'} asked for "
                  f"(bench/gpu_check.py is the check for one; --dry-run runs this one against the fake library)",
                  file=sys.stderr)
            return 2
        mode = f"{n} ranks on {n} of {count} GPUs, torchrun"
    dest = os.environ.get("OUT")
    out = Path(dest, "gpu_check_multi") if dest else Path(tempfile.mkdtemp(prefix="gpu_check_multi."))
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check_multi: {mode}; per-rank results in {out}", flush=True)
    start, bad, verdicts = time.monotonic(), 0, {}
    for name, _fn, limit, gpu_only in STEPS:
        if args.step and name not in args.step:
            continue
        t0 = time.monotonic()
        if args.dry_run and gpu_only:
            res: dict[str, Any] = {"verdict": "SKIPPED", "why": f"skipped: needs a GPU: {gpu_only}"}
        else:
            left = BUDGET_S - (time.monotonic() - start)
            if left < 20:
                res = {"verdict": "ERROR", "why": f"not run: {BUDGET_S} s budget spent"}
            else:
                for stale in out.glob(f"{name}.rank*.json"):
                    stale.unlink()
                note = (launch_dry(name, n, args.fake, out, DRY_TIMEOUT_S * 4 + 10) if args.dry_run
                        else launch_gpu(name, n, out, min(limit, left)))
                per_rank = {}
                for r in range(n):
                    f = out / f"{name}.rank{r}.json"
                    per_rank[r] = json.loads(f.read_text()) if f.is_file() else None
                res = combine(per_rank, note)
        res["seconds"] = round(time.monotonic() - t0, 2)
        verdicts[name] = res
        bad += res["verdict"] in ("FAIL", "ERROR")
        detail = {k: v for k, v in res.items() if k not in ("verdict", "why")}
        print(f"{name:<17} {res['verdict']:<8} {res['why']}  {json.dumps(detail)[:1500]}", flush=True)
    (out / "gpu_check_multi.json").write_text(json.dumps(verdicts, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
