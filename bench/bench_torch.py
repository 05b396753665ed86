"""hsdp against PyTorch FSDP2 on the same stock diffusers model, in the same processes.

A diffusers ``WanTransformer3DModel`` the size of the reference ``base`` preset (dim 512, 8
blocks, ffn 2048), 512 tokens. Two MPI ranks; in each, three copies of the model with the
same weights run interleaved, forward by forward:

- *unsharded*: the whole model on every rank (its weights cast to the dtypes hsdp stores);
- *hsdp*: ``apply_hsdp_to_model`` with the library's defaults (``param_dtype`` aside);
- *FSDP2*: ``fully_shard`` on every block, then on the root, over gloo (its CPU backend).

hsdp's output must equal the unsharded model's bit for bit before anything is timed.
``--load`` measures the loading peak instead (each strategy in fresh processes), ``--hooks``
the per-unit hook overhead (one process).

    .venv/bin/python bench/bench_torch.py            # forward table, fp32 and bf16
    .venv/bin/python bench/bench_torch.py --load     # streaming load vs FSDP2's full-then-shard
    .venv/bin/python bench/bench_torch.py --hooks    # hook overhead per unit
    .venv/bin/python bench/bench_torch.py --build    # RSS after build-then-shard, torch and NumPy
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, launch, machine, reset_peak_rss, table, vm_kib  # noqa: E402

WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=64, in_channels=16, out_channels=16,
    text_dim=256, freq_dim=256, ffn_dim=2048, num_layers=8, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
)
CHECKPOINT = Path(tempfile.gettempdir()) / "hsdp-bench-wan-base"


def is_block(name: str, module: object) -> bool:
    return name.startswith("blocks.") and name.count(".") == 1


def make(seed: int = 0):
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**WAN).eval()


def inputs(tokens_frames: int = 2, size: int = 32):
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, tokens_frames, size, size, generator=g)  # 2 x 16 x 16 patches = 512 tokens
    ctx = torch.randn(1, 64, 256, generator=g)
    return (x, torch.tensor([500]), ctx), {"return_dict": False}


def rss_mib() -> float:
    return vm_kib("VmRSS") / 1024


def gloo_init():
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=int(os.environ["OMPI_COMM_WORLD_RANK"]),
                            world_size=int(os.environ["OMPI_COMM_WORLD_SIZE"]))
    return dist


def fsdp2(model, dtype):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=dtype) if dtype != torch.float32 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def reference(dtype):
    """The unsharded model with the dtypes and input casts hsdp applies."""
    import torch

    from hsdp.adapters.torch import unsharded_reference

    ref = make(0)
    ref._hsdp_shard_conditions = [is_block]
    return unsharded_reference(ref, "float32" if dtype == torch.float32 else "bfloat16")


def worker_forward(reps: int) -> None:
    import torch

    import hsdp

    dist = gloo_init()
    world = hsdp.distributed.init_process_group()
    rows = []
    args, kwargs = inputs()
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        ref = reference(dtype)
        ours = make(0)
        ours._hsdp_shard_conditions = [is_block]
        hsdp.apply_hsdp_to_model(ours, hsdp.HSDPInferenceConfig(enabled=True, param_dtype=name))
        theirs = fsdp2(make(0), dtype)
        with torch.no_grad():
            expect = ref(*args, **kwargs)[0]
            got = ours(*args, **kwargs)[0]
            fs = theirs(*args, **kwargs)[0]
        if not torch.equal(got, expect):
            raise SystemExit(f"rank {world.rank}: hsdp differs from the unsharded model in {name}")
        fsdp_diff = (fs.float() - expect.float()).abs().max().item()

        def fwd(m):
            def run():
                with torch.no_grad():
                    m(*args, **kwargs)
            return run

        for f in (fwd(ref), fwd(ours), fwd(theirs)):  # warm up: hsdp records its order, pools fill
            f()
        t_ref, t_ours, t_theirs = interleaved([fwd(ref), fwd(ours), fwd(theirs)], reps, sync=world.barrier)
        rows.append([name, f"{t_ref:.3f}", f"{t_ours:.3f}", f"{t_theirs:.3f}", f"{t_ours / t_ref:.3f}",
                     f"{t_theirs / t_ref:.3f}", f"{t_ours / t_theirs:.3f}", f"{fsdp_diff:.2g}"])
        del ref, ours, theirs
        gc.collect()
        hsdp.empty_pool()
    if world.rank == 0:
        n_params = sum(p.numel() for p in make(0).parameters())
        print(f"hsdp vs FSDP2 (gloo), diffusers WanTransformer3DModel, {n_params / 1e6:.1f} M parameters, 512 tokens, "
              f"{world.size} ranks ({machine()}, torch {torch.__version__}); median s / forward, {reps} reps")
        print(table(["dtype", "unsharded", "hsdp", "FSDP2", "hsdp / unsharded", "FSDP2 / unsharded",
                     "hsdp / FSDP2", "FSDP2 max |diff|"], rows))
    dist.destroy_process_group()


def worker_load(strategy: str) -> None:
    """Peak RSS of getting the model sharded onto this rank, in a fresh process."""
    import torch

    import hsdp

    dist = gloo_init()
    world = hsdp.distributed.init_process_group()
    from diffusers import WanTransformer3DModel

    if world.rank == 0 and not (CHECKPOINT / "config.json").exists():
        make(0).save_pretrained(CHECKPOINT, max_shard_size="64MB")
    world.barrier()
    import accelerate

    with accelerate.init_empty_weights():  # sizes only: no memory
        block = sum(p.numel() * 2 for p in WanTransformer3DModel(**WAN).blocks[0].parameters())  # bf16
    gc.collect()
    base = rss_mib()
    reset_peak_rss()
    t0 = time.perf_counter()
    if strategy == "hsdp":
        with accelerate.init_empty_weights():
            model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(CHECKPOINT))
        model._hsdp_shard_conditions = [is_block]
        hsdp.load_model_sharded(model, CHECKPOINT, hsdp.HSDPInferenceConfig(enabled=True), progress=False)
        stats = hsdp.memory_stats()
        shard = stats["sharded_bytes"] + stats["whole_bytes"]
    else:  # FSDP2's usual route: the full model on every rank, loaded, then sharded
        model = WanTransformer3DModel.from_pretrained(CHECKPOINT)
        fsdp2(model, torch.bfloat16)
        shard = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    seconds = time.perf_counter() - t0
    peak = vm_kib("VmHWM") / 1024
    target = base + (shard + block) / 2**20
    print(f"RESULT {strategy} rank={world.rank} seconds={seconds:.2f} base={base:.1f} peak={peak:.1f} "
          f"shard={shard / 2**20:.1f} block={block / 2**20:.1f} ratio={peak / target:.3f}")
    dist.destroy_process_group()


def worker_build(framework: str) -> None:
    """RSS above the baseline after building the model in full and sharding it in place. The
    baseline is taken after one model was built and dropped, so that the framework's own
    first-use costs (torch's kernels and thread pools) are not counted as the model's."""
    import hsdp

    world = hsdp.distributed.init_process_group()
    if framework == "numpy":
        from hsdp import models

        build = lambda: models.make_model("base", seed=0)  # noqa: E731
        nbytes_of = models.param_nbytes
    else:
        import torch  # noqa: F401

        build = make
        nbytes_of = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    if framework == "fsdp2":
        gloo_init()
    warm = build()
    del warm
    gc.collect()
    hsdp._C.trim_memory()
    base = rss_mib()
    model = build()
    nbytes = nbytes_of(model)
    built = rss_mib()
    if framework == "fsdp2":
        import torch

        fsdp2(model, torch.bfloat16)
        gc.collect()
        held = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    else:
        model._hsdp_shard_conditions = [is_block]
        hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True))
        held = hsdp.memory_stats()["held_bytes"]
    after = rss_mib()
    print(f"RESULT {framework} rank={world.rank} params={nbytes / 2**20:.1f} built={built - base:.1f} "
          f"after={after - base:.1f} held={held / 2**20:.1f} ratio={(after - base) * 2**20 / nbytes:.3f}")


def hooks(reps: int) -> None:
    """Hook overhead per unit: 128 Linear(8, 8) units in a world of one."""
    import torch

    import hsdp

    hsdp.distributed.init_process_group("single")

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(128))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    plain, sharded = Chain(), Chain()
    sharded.load_state_dict(plain.state_dict())
    sharded._hsdp_shard_conditions = [lambda n, m: n.startswith("layers.") and n.count(".") == 1]
    hsdp.apply_hsdp_to_model(sharded, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(plain(x), sharded(x))

    def fwd(m):
        def run():
            with torch.no_grad():
                for _ in range(10):
                    m(x)
        return run

    # FSDP2 on the same chain, a world of one over gloo, for scale
    os.environ.setdefault("OMPI_COMM_WORLD_RANK", "0")
    os.environ.setdefault("OMPI_COMM_WORLD_SIZE", "1")
    dist = gloo_init()
    theirs = Chain()
    theirs.load_state_dict(plain.state_dict())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for layer in theirs.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    # Medians, and minimums: interference on a shared machine only ever adds time, and at a
    # few microseconds per unit it moves the median by as much as the overhead itself.
    fns = [fwd(plain), fwd(sharded), fwd(theirs)]
    both = interleaved(fns, reps, stat=lambda ts: (statistics.median(ts), min(ts)))  # type: ignore[arg-type,return-value]
    med, low = [b[0] for b in both], [b[1] for b in both]
    rows = []
    for label, k in (("unsharded", 0), ("hsdp (defaults but param_dtype float32)", 1), ("FSDP2 (gloo)", 2)):
        over = [(t[k] - t[0]) / 10 / 129 * 1e6 for t in (med, low)]
        rows.append([label, f"{med[k] / 10 * 1e6:.0f}", f"{low[k] / 10 * 1e6:.0f}",
                     "-" if k == 0 else f"{over[0]:.1f}", "-" if k == 0 else f"{over[1]:.1f}",
                     ("yes" if over[0] <= 10 else "no") if k == 1 else "-"])
    print(f"Hook overhead per unit per forward, torch, 128 Linear(8, 8) units + root, world of one ({machine()}); "
          f"{reps} interleaved repetitions of 10 forwards")
    print(table(["path", "median us / forward", "min us / forward", "overhead us / unit (median)",
                 "overhead us / unit (min)", "median <= 10 us"], rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", action="store_true", help="measure the loading peak instead")
    ap.add_argument("--hooks", action="store_true", help="measure the hook overhead per unit instead")
    ap.add_argument("--build", action="store_true", help="measure the RSS left after build-then-shard instead")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 5; 30 with --hooks)")
    ap.add_argument("--worker", choices=["forward", "hsdp", "fsdp2", "build-torch", "build-numpy", "build-fsdp2"],
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "forward":
        worker_forward(a.reps or 5)
    elif a.worker and a.worker.startswith("build-"):
        worker_build(a.worker.split("-")[1])
    elif a.worker:
        worker_load(a.worker)
    elif a.hooks:
        hooks(a.reps if a.reps is not None else 30)  # microseconds: more repetitions by default
    elif a.build:
        rows = []
        for fw in ("numpy", "torch", "fsdp2"):
            for line in launch(2, __file__, "--worker", f"build-{fw}").splitlines():
                if line.startswith("RESULT"):
                    kv = dict(f.split("=") for f in line.split()[2:])
                    rows.append([fw, kv["rank"], kv["params"],
                                 kv["built"], kv["after"], kv["held"], kv["ratio"]])
        print(f"Build in full, then shard in place (hsdp: apply_hsdp_to_model, defaults, bf16 shards; FSDP2: "
              f"fully_shard, fp32 shards), 2 ranks ({machine()}); MiB above the baseline RSS; "
              "ratio = after / parameter bytes")
        print(table(["path", "rank", "params MiB", "built", "after sharding", "shards held", "ratio"], rows))
    elif a.load:
        rows = []
        for strategy in ("hsdp", "fsdp2"):
            for line in launch(2, __file__, "--worker", strategy).splitlines():
                if line.startswith("RESULT"):
                    kv = dict(f.split("=") for f in line.split()[2:])
                    above = float(kv["peak"]) - float(kv["base"])
                    rows.append([strategy, kv["rank"], kv["seconds"], kv["base"], kv["peak"],
                                 f"{above:.1f}", kv["shard"], kv["block"], kv["ratio"]])
        print(f"Loading peak per rank, diffusers Wan (base size), 2 ranks ({machine()}); "
              "ratio = peak / (baseline + shard + one bf16 block), goal <= 1.1")
        print(table(["strategy", "rank", "s", "baseline MiB", "peak MiB", "peak - baseline", "shard MiB", "block MiB",
                     "ratio"], rows))
    else:
        print(launch(2, __file__, "--worker", "forward", "--reps", str(a.reps or 5)), end="")


if __name__ == "__main__":
    main()
