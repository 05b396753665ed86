"""One rank of a multi-rank torch parity check (started by tests/test_torch.py under mpiexec):
shard a stock diffusers model over the (R, S) mesh and require its output to equal the
unsharded reference bit for bit, over several forwards (prefetch on), and the gathered
state dict to equal the reference's.

usage: torch_worker.py R S SPEC [SPEC ...]   SPEC: KIND:PARAM_DTYPE, or "wire" (R = 1): a
                                            bfloat16 Wan with a float8 wire, against without;
                                            "load=DIR:PARAM_DTYPE": a Wan save_pretrained folder
                                            streamed in; "mesh=RxS": the specs after it on
                                            that mesh (R x S = the world size), so one launch
                                            checks every mesh of its world size
"""

from __future__ import annotations

import sys

import torch

import hsdp
from torch_models import MODELS, check_on_device, reference, run, target_device, worker_world


def main(kind: str, param_dtype: str, r: int, s: int) -> None:
    world = worker_world()
    assert world.backend in ("mpi", "fakedev", "nccl") and world.size == r * s, (world.backend, world.size)
    make, _, cond = MODELS[kind]
    model = make(0)
    model._hsdp_shard_conditions = [cond]  # on the instance: a stock model needs no subclass
    before = dict(model.named_parameters())
    cfg = hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=r, hsdp_shard_size=s, param_dtype=param_dtype)
    hsdp.apply_hsdp_to_model(model, cfg, target_device=target_device(world))
    check_on_device(world, model)
    assert all(before[n] is p for n, p in model.named_parameters()), "parameter identity"
    expect = run(reference(kind, param_dtype), kind)
    for i in range(3):  # the first forward records, the later ones prefetch
        got = run(model, kind)
        if got.dtype != expect.dtype or not torch.equal(got, expect):
            diff = (got.float() - expect.float()).abs().max().item()
            raise SystemExit(f"rank {world.rank}: forward {i} differs from the unsharded model (max |diff| {diff})")
    full = hsdp.full_state_dict(model)
    ref_sd = reference(kind, param_dtype).state_dict()
    assert set(full) == set(ref_sd), set(full) ^ set(ref_sd)
    bad = [k for k, v in ref_sd.items() if not torch.equal(full[k], v)]
    assert not bad, f"rank {world.rank}: state dict differs at {bad[:3]}"
    units = hsdp.get_units(model)
    assert sum(u.unit.chunk_bytes for u in units) * s == sum(u.unit.total_bytes for u in units)  # 1/S each
    print(f"rank {world.rank}: ok {kind} {param_dtype} {r}x{s} on {world.backend}")


def load(folder: str, param_dtype: str, r: int, s: int) -> None:
    import accelerate
    from diffusers import WanTransformer3DModel

    from torch_models import is_wan_block

    world = hsdp.distributed.init_process_group()
    with accelerate.init_empty_weights():
        model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder)).eval()
    model._hsdp_shard_conditions = [is_wan_block]
    cfg = hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=r, hsdp_shard_size=s, param_dtype=param_dtype)
    hsdp.load_model_sharded(model, folder, cfg, progress=False)
    report = hsdp.checkpoint.load_report(model)
    expect = run(reference("wan", param_dtype), "wan")
    for _ in range(2):
        got = run(model, "wan")
        assert torch.equal(got, expect), f"rank {world.rank}: streamed model differs"
    # each rank read its own shard (and the parameters kept whole), not the whole file
    assert report.strategy == "streaming" and report.bytes_read < report.bytes_read_total, report
    print(f"rank {world.rank}: ok load {param_dtype} {r}x{s} read {report.bytes_read} of {report.bytes_read_total}")


def wire(s: int) -> None:
    """Wan in bfloat16 sharded twice over S ranks, with and without the float8 wire: the
    wire's shards weigh <= 0.56 of the bfloat16 ones, its forwards are within a relative L2
    error of 0.05 of the bfloat16 sharded model's (and the same on every forward), the kept
    float32 time embedder and the 0-d / non-float parameters travel as they are, the second
    gather reads the peers' float8 shards directly, and wire_error reports each weight within
    e4m3's bound of the source."""
    from torch_models import make_wan_wide

    world = hsdp.distributed.init_process_group()
    assert world.backend == "mpi" and world.size == s, (world.backend, world.size)
    args, kwargs = MODELS["wan"][1]()

    def build(wire_dtype: str | None) -> tuple[torch.nn.Module, int]:
        model = make_wan_wide(0)
        model._hsdp_shard_conditions = [MODELS["wan"][2]]
        hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(
            enabled=True, hsdp_shard_size=s, param_dtype="bfloat16", wire_dtype=wire_dtype))
        # what sharded_bytes counts for this model's units (other models in this process come
        # and go with the garbage collector, so the global counter's delta would not do)
        return model, sum(len(st.unit.shard_bytes()) for st in hsdp.get_units(model))

    plain, plain_bytes = build(None)
    fp8, fp8_bytes = build("float8_e4m3fn")
    ratio = fp8_bytes / plain_bytes
    assert ratio <= 0.56, f"rank {world.rank}: float8 shards are {ratio:.3f} of the bfloat16 ones"
    with torch.inference_mode():
        expect = plain(*args, **kwargs)[0].float()
        outs = [fp8(*args, **kwargs)[0] for _ in range(2)]
    assert outs[0].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1]), "float8 forwards differ"
    rel = ((outs[0].float() - expect).norm() / expect.norm()).item()
    assert rel <= 0.05, f"rank {world.rank}: relative L2 error {rel:.4f} of the float8 wire's output"
    for st in hsdp.get_units(fp8):
        assert st.unit.is_encoded and st.unit.gather_path == ("direct" if s > 1 else "collective"), st.label
        for name, flag, dt in zip(st.names, st.unit.wire_params, st.unit.dtypes):
            kept = "time_embedder" in name  # Wan's _keep_in_fp32_modules
            assert flag == (not kept and dt == "bfloat16"), (name, flag, dt)
    ref = make_wan_wide(0).to(torch.bfloat16).state_dict()
    errs = hsdp.wire_error(fp8, ref)
    assert errs and all(e.max_abs_error <= e.max_abs_value * 0.07 for e in errs.values()), errs
    worst = max(e.rel_l2 for e in errs.values())
    assert worst < 0.05, worst
    print(f"rank {world.rank}: ok wire {s} ratio {ratio:.3f} rel_l2 {rel:.4f} worst weight rel_l2 {worst:.4f}")


if __name__ == "__main__":
    r, s = int(sys.argv[1]), int(sys.argv[2])
    for spec in sys.argv[3:]:
        if spec.startswith("mesh="):  # another mesh of the same world, for the specs after it
            r, s = (int(n) for n in spec[len("mesh="):].split("x"))
            continue
        if spec.startswith("load="):
            folder, dtype = spec[len("load="):].rsplit(":", 1)
            load(folder, dtype, r, s)
            continue
        if spec == "wire":
            assert r == 1, "the wire check runs on a (1, S) mesh"
            wire(s)
            continue
        if spec.startswith("ulysses:"):  # HSDP x Ulysses over the same world, in this launch
            import parallel_torch_worker

            parallel_torch_worker.check(spec.split(":")[1])
            continue
        kind, dtype = spec.split(":")
        main(kind, dtype, r, s)
