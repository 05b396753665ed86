"""One rank of a multi-rank test (started by tests/test_multirank.py under mpiexec).

`python tests/mpi_worker.py REPLICATE[,REPLICATE...] SCENARIO...` runs each scenario on a
(REPLICATE, world // REPLICATE) mesh (each mesh in turn, so one launch covers every mesh of
its world size) and asserts, on every rank, that the sharded model matches an unsharded one
built from the same seed in this same process. A failure raises
out of main; hsdp then skips MPI_Finalize at exit, so mpiexec ends the other ranks instead
of leaving them waiting in a collective.
"""

from __future__ import annotations

import gc
import os
import sys

import numpy as np

import hsdp
from hsdp import models
from hsdp.world.distributed import init_process_group

F32 = hsdp.HSDPInferenceConfig  # noqa: N816 (a short alias keeps the scenarios readable)


def round_params_to(model, dtype: str) -> None:
    """What a bf16 shard holds: every floating weight rounded to dtype."""
    for p in model.parameters():
        if p.is_floating_point() and p.ndim > 0:
            p.data = hsdp._C.round_to(np.ascontiguousarray(p.data, dtype=np.float32), dtype)


def reference(variant: str, inputs, round_to: str | None = None, keep: tuple[str, ...] = ()):
    model = models.make_model("tiny", variant=variant, seed=0)
    if round_to:
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.ndim > 0 and not name.startswith(keep):
                p.data = hsdp._C.round_to(np.ascontiguousarray(p.data, dtype=np.float32), round_to)
    return model(*inputs)


def expected_unit_bytes(params, storage: tuple[str, ...], shard: int) -> int:
    """The flat layout recomputed independently of the C core."""
    off = 0
    for p, dt in zip(params, storage):  # a parameter starts at a multiple of 256, 128 or 64 bytes
        nbytes = p.numel() * hsdp.dtypes.as_dtype(dt).itemsize
        align = 256 if nbytes >= 256 else 128 if nbytes >= 128 else 64  # hsdp_slot_align
        off = -(-off // align) * align + nbytes
    return -(-off // (64 * shard)) * (64 * shard)  # the unit: 64 * S (HSDP_ALIGN)


def check_accounting(model, shard: int, whole_bytes: int) -> None:
    units = hsdp.get_units(model)
    total = 0
    for u in units:
        exp = expected_unit_bytes(u.params, u.storage_dtypes, shard)
        assert u.unit.total_bytes == exp, (u.label, u.unit.total_bytes, exp)
        total += -(-u.unit.total_bytes // shard)
    stats = hsdp.memory_stats()
    assert stats["sharded_bytes"] == total, (stats, total)
    assert stats["whole_bytes"] == whole_bytes, (stats, whole_bytes)
    assert stats["held_bytes"] == total + whole_bytes + stats["unsharded_bytes"] + stats["pooled_bytes"]


def scenario_float32(R: int) -> None:
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=3)
    ref = reference("plain", x)
    model = models.make_model("tiny", seed=0)
    params_before = {n: p for n, p in model.named_parameters()}
    cfg = hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R, param_dtype="float32")
    assert hsdp.apply_hsdp_to_model(model, cfg) is model
    S = hsdp.distributed.get_world_size() // R
    # identity kept, every parameter sharded and unreadable outside a forward
    for n, p in model.named_parameters():
        assert p is params_before[n], n
        assert not p.requires_grad
        try:
            p.data
        except RuntimeError as e:
            assert "sharded" in str(e), e
        else:
            raise AssertionError(f"reading sharded {n} did not raise")
    check_accounting(model, S, 0)
    out1 = model(*x)
    assert out1.dtype == np.float32
    assert np.array_equal(out1, ref), np.abs(out1 - ref).max()
    assert hsdp.memory_stats()["unsharded_bytes"] == 0
    out2 = model(*x)
    assert np.array_equal(out1, out2)
    # explicit unshard: every parameter readable and equal to the original
    ref_model = models.make_model("tiny", seed=0)
    hsdp.unshard(model, recurse=True)
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert np.array_equal(p.data, q.data), n
        assert not p.data.flags.writeable
    out3 = model(*x)  # a forward leaves an explicit unshard in place
    assert np.array_equal(out3, ref)
    assert hsdp.memory_stats()["unsharded_bytes"] > 0
    hsdp.reshard(model, recurse=True)
    assert hsdp.memory_stats()["unsharded_bytes"] == 0
    del model, out1, out2, out3


def scenario_bfloat16(R: int) -> None:
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=4)
    ref = reference("plain", x, round_to="bfloat16")
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R))
    assert all(p.dtype == hsdp.bfloat16 for p in model.parameters())
    out = model(*x)
    assert np.array_equal(out, ref), np.abs(out - ref).max()
    assert np.array_equal(model(*x), out)
    S = hsdp.distributed.get_world_size() // R
    check_accounting(model, S, 0)


def scenario_keep_unsharded(R: int) -> None:
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=5)
    ref = reference("plain", x, round_to="bfloat16")
    model = models.make_model("tiny", seed=0)
    cfg = hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R, reshard_after_forward=False)
    hsdp.apply_hsdp_to_model(model, cfg)
    assert hsdp.memory_stats()["unsharded_bytes"] == 0
    out = model(*x)
    assert np.array_equal(out, ref)
    units = hsdp.get_units(model)
    assert all(u.unit.is_unsharded for u in units)
    held = sum(u.unit.total_bytes + u.unit.widened_bytes for u in units)
    assert hsdp.memory_stats()["unsharded_bytes"] == held
    assert np.array_equal(model(*x), out)
    hsdp.reshard(model, recurse=True)
    assert hsdp.memory_stats()["unsharded_bytes"] == 0


def scenario_ignored(R: int) -> None:
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=6)
    ref = reference("ignored", x, round_to="bfloat16", keep=("time_embedder.",))
    model = models.make_model("tiny", variant="ignored", seed=0)
    te = {n: p for n, p in model.time_embedder.named_parameters()}
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R), "cpu")
    for n, p in model.time_embedder.named_parameters():
        assert p is te[n] and p.dtype == hsdp.float32 and p.data.dtype == np.float32, n
        # whole, ordinary arrays: not read-only views into an unsharded buffer
        assert p.data.flags.writeable, n
    held = {id(p) for u in hsdp.get_units(model) for p in u.params}
    assert not held & {id(p) for p in te.values()}
    out = model(*x)
    assert np.array_equal(out, ref), np.abs(out - ref).max()
    S = hsdp.distributed.get_world_size() // R
    check_accounting(model, S, sum(p.nbytes for p in te.values()))


def scenario_quantized(R: int) -> None:
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=7)
    ref = reference("quantized", x, round_to="bfloat16")
    model = models.make_model("tiny", variant="quantized", seed=0)
    whole = {n: p for n, p in model.named_parameters() if p.ndim == 0 or not p.is_floating_point()}
    assert any(p.dtype == hsdp.dtypes.int8 for p in whole.values())
    assert any(p.ndim == 0 for p in whole.values())
    before = {n: p.data.copy() for n, p in whole.items()}
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R), "cpu")
    for n, p in model.named_parameters():
        if n in whole:
            assert p is whole[n] and np.array_equal(p.data, before[n]) and p.data.dtype == before[n].dtype, n
    out = model(*x)
    assert np.array_equal(out, ref), np.abs(out - ref).max()
    S = hsdp.distributed.get_world_size() // R
    check_accounting(model, S, sum(p.nbytes for p in whole.values()))


def scenario_streaming(R: int) -> None:
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=8)
    cfg = hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R)
    whole = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(whole, cfg)
    expect = whole(*x)
    model = models.make_model("tiny", seed=0)
    ctx = hsdp.prepare_hsdp_shard_context(model, cfg)
    for block in model.blocks:
        hsdp.shard_hsdp_module(block, ctx)
    hsdp.finalize_hsdp_root(model, ctx)
    assert [u.fqn for u in hsdp.get_units(model)] == [f"blocks.{i}" for i in range(len(model.blocks))] + [""]
    for a, b in zip(hsdp.get_units(model), hsdp.get_units(whole)):
        assert np.array_equal(a.unit.shard_bytes(), b.unit.shard_bytes()), a.label
    assert np.array_equal(model(*x), expect)


def scenario_replicas(R: int) -> None:
    """Replicas hold identical shards; a broadcast over the replicate group restores one."""
    mesh = hsdp.init_device_mesh("cpu", (R, hsdp.distributed.get_world_size() // R))
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R))
    unit = hsdp.get_units(model)[0].unit
    mine = unit.shard_bytes().copy()
    if mesh.replicate_rank != 0:
        unit.write(0, np.zeros(hsdp.get_units(model)[0].params[0].shape, np.float32))
    unit.broadcast_shard(mesh.replicate_group, 0)
    assert np.array_equal(unit.shard_bytes(), mine)
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=9)
    assert np.array_equal(model(*x), reference("plain", x, round_to="bfloat16"))


class SkippyDiT(models.VideoDiT):
    """Does not call block 1 at all when the timestep is small: a forward that departs from
    the recorded unit order on some calls."""

    def forward(self, x, timestep, context):
        full = self._modules["blocks"]
        if float(np.asarray(timestep).reshape(-1)[0]) < 500.0:
            self._modules["blocks"] = hsdp.nn.ModuleList([b for i, b in enumerate(full) if i != 1])
        try:
            return super().forward(x, timestep, context)
        finally:
            self._modules["blocks"] = full


def scenario_prefetch(R: int) -> None:
    """Prefetch depth 0, 1, 2 and a byte cap give identical outputs over repeated forwards,
    and after the first forward no forward allocates an unsharded buffer."""
    cfgs = {
        "off": hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R, prefetch_depth=0),
        "d1": hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R),
        "d2": hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R, prefetch_depth=2),
    }
    xs = [models.make_inputs(models.DiTConfig.preset("tiny"), seed=s) for s in (10, 11, 12)]
    outs = {}
    for name, cfg in cfgs.items():
        model = models.make_model("tiny", seed=0)
        hsdp.apply_hsdp_to_model(model, cfg)
        if name == "d1":  # cap: room for the block computing and one more, not two
            units = hsdp.get_units(model)
            cfg_cap = units[0].full_bytes * 2 + units[-1].full_bytes
            model._hsdp_context.schedule.max_bytes = cfg_cap
        outs[name] = [model(*x) for x in xs[:1]]
        allocs = hsdp.memory_stats()["buffer_allocs"]
        outs[name] += [model(*x) for x in xs[1:]]
        assert hsdp.memory_stats()["buffer_allocs"] == allocs, (name, allocs, hsdp.memory_stats())
        assert hsdp.memory_stats()["unsharded_bytes"] == 0
        sched = model._hsdp_context.schedule
        assert not sched.recording and sched.rerecords == 0
        if name != "off":
            assert sched.prefetches > 0, name
        del model
        gc.collect()
    for name in ("d1", "d2"):
        for a, b in zip(outs["off"], outs[name]):
            assert np.array_equal(a, b), name
    ref = reference("plain", xs[0], round_to="bfloat16")
    assert np.array_equal(outs["off"][0], ref)
    hsdp.empty_pool()
    assert hsdp.memory_stats()["pooled_bytes"] == 0


def scenario_skip(R: int) -> None:
    """A forward that skips a block on some calls runs correctly with prefetch on."""
    cfg = hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R, prefetch_depth=2)
    ref = SkippyDiT(models.DiTConfig.preset("tiny"))
    models.init_weights(ref, 0)
    round_params_to(ref, "bfloat16")
    model = SkippyDiT(models.DiTConfig.preset("tiny"))
    models.init_weights(model, 0)
    hsdp.apply_hsdp_to_model(model, cfg)
    x, _, ctx = models.make_inputs(models.DiTConfig.preset("tiny"), seed=13)
    for t in (900.0, 900.0, 100.0, 100.0, 900.0, 100.0):
        ts = np.full((x.shape[0],), t, np.float32)
        assert np.array_equal(model(x, ts, ctx), ref(x, ts, ctx)), t
        assert not any(u.unit.holds_buffers for u in hsdp.get_units(model))
    # one re-record (the first skip); later departures go on with the two recorded orders
    sched = model._hsdp_context.schedule
    assert sched.rerecords == 1 and sched.switches == 2


def scenario_async_unshard(R: int) -> None:
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R))
    handle = hsdp.unshard(model, recurse=True, async_op=True)
    handle.wait()
    assert handle.is_completed()
    ref = models.make_model("tiny", seed=0)
    round_params_to(ref, "bfloat16")
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert np.array_equal(p.data, q.data), n
    hsdp.reshard(model, recurse=True)
    # a forward waits for an explicit async unshard still in flight and keeps it afterwards
    handle = hsdp.unshard(model.blocks[0], async_op=True)
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=14)
    assert np.array_equal(model(*x), reference("plain", x, round_to="bfloat16"))
    assert hsdp.get_units(model)[0].unit.is_unsharded
    handle.wait()
    hsdp.reshard(model.blocks[0])


class Odd(hsdp.nn.Module):
    """Parameters of awkward sizes (primes, one element) and a nested selected child, so
    that chunk boundaries fall inside parameters and inside the nested unit."""

    def __init__(self, n: int) -> None:
        super().__init__()
        rng = np.random.default_rng(n)
        self.a = hsdp.nn.Parameter(rng.standard_normal(n).astype(np.float32))
        self.b = hsdp.nn.Parameter(rng.standard_normal((1,)).astype(np.float32))
        self.c = hsdp.nn.Parameter(rng.standard_normal((n, 3)).astype(np.float32))
        self.inner = hsdp.nn.Linear(3, 5)
        self.inner.weight.data = rng.standard_normal((5, 3)).astype(np.float32)
        self.inner.bias.data = rng.standard_normal(5).astype(np.float32)

    def forward(self, x):
        return self.inner(x * self.b.data + self.c.data.sum(0))[..., :3] + self.a.data.sum()


class OddModel(hsdp.nn.Module):
    _hsdp_shard_conditions = [
        lambda name, m: name.startswith("parts.") and name.count(".") == 1,
        lambda name, m: name.endswith(".inner"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.parts = hsdp.nn.ModuleList([Odd(n) for n in (7, 13, 1, 101, 3)])
        self.scale = hsdp.nn.Parameter(np.array(0.5, np.float32))  # 0-dim: kept whole
        self.bias = hsdp.nn.Parameter(np.arange(11, dtype=np.float32))  # 11 floats in the root

    def forward(self, x):
        for p in self.parts:
            x = p(x)
        return x * self.scale.data + self.bias.data[:3]


def scenario_uneven(R: int) -> None:
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    expect = OddModel()(x)
    for dtype in ("float32", "bfloat16"):
        model = OddModel()
        if dtype == "bfloat16":
            ref = OddModel()
            round_params_to(ref, "bfloat16")
            expect = ref(x)
        cfg = hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R, param_dtype=dtype)
        hsdp.apply_hsdp_to_model(model, cfg, target_device="cpu")
        units = [u.fqn for u in hsdp.get_units(model)]
        assert units == [f"parts.{i}{s}" for i in range(5) for s in (".inner", "")] + [""], units
        S = hsdp.distributed.get_world_size() // R
        check_accounting(model, S, 4)  # the 0-dim float32 scale
        for _ in range(2):
            assert np.array_equal(model(x), expect), dtype
        del model
        gc.collect()


def scenario_resident_budget(R: int) -> None:
    """A residency budget over real ranks: the same units kept on every rank, outputs equal to
    the budget-free model, fewer gathers; "auto" agreed on; budgets that differ between the
    ranks of a shard group an error on every rank, then and on every later forward."""
    world = hsdp.distributed.get_world_group()
    xs = [models.make_inputs(models.DiTConfig.preset("tiny"), seed=s) for s in (20, 21)]
    free = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(free, F32(enabled=True, hsdp_replicate_size=R))
    expect = [free(*x) for x in xs]
    block = hsdp.get_units(free)[0].full_bytes
    del free
    gc.collect()
    for budget in (block, "auto"):
        model = models.make_model("tiny", seed=0)
        hsdp.apply_hsdp_to_model(model, F32(enabled=True, hsdp_replicate_size=R, resident_bytes=budget))
        for _ in range(3):
            for x, e in zip(xs, expect):
                assert np.array_equal(model(*x), e), budget
        stats = hsdp.residency_stats(model)
        n_kept = len(stats["resident_units"])
        every = np.zeros(world.size, dtype=np.int64)  # every rank keeps as many units
        world.all_gather(np.array([n_kept], dtype=np.int64), every)
        assert every.tolist() == [n_kept] * world.size, (budget, every)
        assert stats["last_forward_gathers"] == 3 - len(stats["resident_units"]), stats
        assert (stats["resident_units"] == ["blocks.0"]) if budget == block else (len(stats["resident_units"]) == 3)
        del model
        gc.collect()
    if world.size // R > 1:  # a shard group of several ranks: rank-dependent budgets disagree
        model = models.make_model("tiny", seed=0)
        hsdp.apply_hsdp_to_model(model, F32(enabled=True, hsdp_replicate_size=R,
                                            resident_bytes=block * (1 + world.rank)))
        for what in ("differs between the ranks", "differs between the ranks"):
            try:
                model(*xs[0])
            except (ValueError, RuntimeError) as exc:
                assert what in str(exc), exc
            else:
                raise AssertionError("disagreeing residency budgets did not raise")
        del model
        gc.collect()


SCENARIOS = {name[9:]: fn for name, fn in globals().items() if name.startswith("scenario_")}


def main() -> None:
    replicas = [int(r) for r in sys.argv[1].split(",")]
    names = sys.argv[2:] or list(SCENARIOS)
    world = init_process_group(os.environ.get("HSDP_TEST_BACKEND", "auto"))  # tests/mpirun.py FAKEDEV
    for R in replicas:
        for name in names:
            SCENARIOS[name](R)
            # A sharded module and its unit state refer to each other; free the scenario's model
            # now so the next scenario's byte accounting starts from zero.
            gc.collect()
            world.barrier()
        mesh = f"({R}x{world.size // R})"
        print(f"rank {world.rank}/{world.size} mesh {mesh}: {' '.join(names)} OK on {world.backend}", flush=True)


if __name__ == "__main__":
    # A failure raises out of main: hsdp then leaves MPI unfinalised at exit, so mpiexec ends
    # the job instead of leaving the other ranks waiting in a collective.
    main()
