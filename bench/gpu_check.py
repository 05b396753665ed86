"""The GPU check of the NCCL backend, on one GPU (an NCCL world of one).

    python bench/gpu_check.py            # prints a table and a JSON line; writes $OUT/gpu_check.json if OUT is set

1. **Parity.** A stock diffusers ``WanTransformer3DModel`` (a 1.3B-like block shape, fewer
   blocks) sharded with hsdp onto the GPU (``target_device="cuda"``, bf16) against the same
   weights unsharded on the GPU (``hsdp.adapters.torch.unsharded_reference``): bit for bit.
2. **Host cost of ``start_unshard``** on a block unit: the host time of the call alone, which
   only enqueues the gather on the side stream (goal: at most 50 us).
3. **A 256 MiB gather against a device-to-device copy** of the same bytes, timed with CUDA
   events over many repetitions (goal: copy time / gather time at least 0.9).
4. **Overlap.** CUDA events on the compute stream around each block's forward, and on the
   gather stream around the gather of the next block (which the block's pre-forward hook
   starts): the share of gather time that falls inside the block's compute.

It needs a GPU; without one it says so and exits with status 2. Nothing here changes the
card's settings.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=6, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
)


def is_block(name: str, module: object) -> bool:
    return name.startswith("blocks.") and name.count(".") == 1


def make(torch, seed: int = 0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**WAN).eval()


def inputs(torch, device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 4, 64, 64, generator=g)  # 4 x 32 x 32 patches = 4096 tokens
    ctx = torch.randn(1, 128, 4096, generator=g)
    return (x.to(device), torch.tensor([500], device=device), ctx.to(device)), {"return_dict": False}


def parity(torch, hsdp) -> tuple[dict, object]:
    from hsdp.adapters.torch import unsharded_reference

    ref = unsharded_reference(make(torch), "bfloat16").to("cuda")
    model = make(torch)
    model._hsdp_shard_conditions = [is_block]
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="bfloat16"),
                             target_device="cuda")
    args, kw = inputs(torch, "cuda")
    with torch.no_grad():
        want = ref(*args, **kw)[0]
        got = [model(*args, **kw)[0] for _ in range(3)]  # the first records the order, later ones prefetch
    torch.cuda.synchronize()
    exact = all(torch.equal(want, g) for g in got)
    paths = sorted({st.unit.gather_path for st in hsdp.get_units(model)})
    del ref
    return {"bit_exact_bf16": exact, "max_abs_diff": float((want.float() - got[-1].float()).abs().max()),
            "gather_paths": paths, "units": len(hsdp.get_units(model))}, model


def start_unshard_host_us(torch, hsdp, model, reps: int = 200) -> dict:
    unit = hsdp.get_units(model)[0].unit  # a block
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        unit.start_unshard()
        t1 = time.perf_counter_ns()
        unit.wait()
        unit.reshard()
        times.append((t1 - t0) / 1000)
    torch.cuda.synchronize()
    return {"start_unshard_host_us_median": statistics.median(times), "start_unshard_host_us_min": min(times),
            "block_unit_bytes": unit.total_bytes}


def gather_vs_copy(torch, hsdp, reps: int = 50) -> dict:
    from hsdp import _C

    nbytes = 256 << 20
    world = hsdp.distributed.get_world_group()
    u = _C.Unit(world, ["bfloat16"], [(nbytes // 2,)], name="bench-256MiB", device="cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    u.unshard(), u.reshard(), dst.copy_(src)  # warm: the shard's upload, the pool, the copy kernel
    torch.cuda.synchronize()

    def timed(step) -> float:
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
    return {"gather_256MiB_ms": statistics.median(g_ms), "d2d_copy_256MiB_ms": statistics.median(c_ms),
            "copy_over_gather": statistics.median(ratios)}


def overlap(torch, hsdp, model) -> dict:
    """Per block i: compute [c0, c1] on the compute stream; gather of block i+1 [g0, g1] on
    the gather stream (g0 recorded before hsdp's pre-hook starts it, g1 right after)."""
    from hsdp import nccl

    comm = nccl.comm_stream()
    blocks = list(model.blocks)
    ev: dict[str, list] = {k: [] for k in ("c0", "c1", "g0", "g1")}

    def event(stream=None):
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream) if stream is not None else e.record()
        return e

    handles = []
    for b in blocks:
        handles.append(b.register_forward_pre_hook(lambda m, a: ev["g0"].append(event(comm)), prepend=True))
        handles.append(b.register_forward_pre_hook(lambda m, a: (ev["g1"].append(event(comm)), ev["c0"].append(event()))))
        handles.append(b.register_forward_hook(lambda m, a, o: ev["c1"].append(event())))
    args, kw = inputs(torch, "cuda")
    with torch.no_grad():
        model(*args, **kw)
    torch.cuda.synchronize()
    for h in handles:
        h.remove()
    base = ev["c0"][0]
    t = {k: [base.elapsed_time(e) for e in v] for k, v in ev.items()}
    rows, inside, total = [], 0.0, 0.0
    for i in range(len(blocks) - 1):  # the gather started in block i's pre-hook is block i+1's
        g0, g1, c0, c1 = t["g0"][i], t["g1"][i], t["c0"][i], t["c1"][i]
        rows.append({"block": i, "compute_ms": (c0, c1), "next_gather_ms": (g0, g1)})
        total += max(g1 - g0, 0.0)
        inside += max(min(g1, c1) - max(g0, c0), 0.0)
    return {"overlap_rows": rows, "gather_ms_total": total, "gather_ms_inside_compute": inside,
            "overlap_fraction": inside / total if total > 0 else None}


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no GPU is visible (torch.cuda.is_available() is False); this check needs one", file=sys.stderr)
        return 2
    import hsdp

    world = hsdp.distributed.init_process_group("nccl")
    out = {"device": torch.cuda.get_device_name(), "nccl_version": hsdp._C.nccl_version(), "world": world.size,
           "torch": torch.__version__}
    model = None
    for name in ("parity", "start_unshard", "gather_vs_copy", "overlap"):
        t0 = time.time()
        try:
            if name == "parity":
                res, model = parity(torch, hsdp)
            elif name == "start_unshard":
                res = start_unshard_host_us(torch, hsdp, model)
            elif name == "gather_vs_copy":
                res = gather_vs_copy(torch, hsdp)
            else:
                res = overlap(torch, hsdp, model)
        except Exception as exc:  # report every step, even after one fails
            res = {"error": f"{type(exc).__name__}: {exc}"}
        res["seconds"] = round(time.time() - t0, 1)
        out[name] = res
        print(f"{name}: {json.dumps(res)[:2000]}", flush=True)
    goals = {
        "bit_exact_bf16": out["parity"].get("bit_exact_bf16") is True,
        "start_unshard_le_50us": (out["start_unshard"].get("start_unshard_host_us_median") or 1e9) <= 50,
        "gather_ge_0.9_of_copy": (out["gather_vs_copy"].get("copy_over_gather") or 0) >= 0.9,
        "overlap_seen": (out["overlap"].get("overlap_fraction") or 0) > 0.5,
    }
    out["goals"] = goals
    print("GOALS " + json.dumps(goals), flush=True)
    dest = os.environ.get("OUT")
    if dest:
        Path(dest, "gpu_check.json").write_text(json.dumps(out, indent=1))
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
