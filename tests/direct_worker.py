"""One rank of the direct-gather checks (started by tests/test_direct_gather.py under mpiexec).

`python tests/direct_worker.py EXPECT SCENARIO` with EXPECT "direct" or "collective": the path
every unit's gathers must take after the first (collective) one. A failure raises out of
main; hsdp then skips MPI_Finalize at exit, so mpiexec ends the other ranks.
"""

from __future__ import annotations

import gc
import sys
import time

import numpy as np

import hsdp
from hsdp import models
from hsdp.world.distributed import init_process_group


def sharded(seed: int = 0):
    model = models.make_model("tiny", seed=seed)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))
    return model


def scenario_paths(expect: str) -> None:
    """Every unit gathers collectively once, then by the agreed path; outputs stay exact."""
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=3)
    ref = models.make_model("tiny", seed=0)(*x)
    model = sharded()
    units = hsdp.get_units(model)
    assert {u.unit.gather_path for u in units} == {"unset"}
    for _ in range(3):
        out = model(*x)
        assert np.array_equal(out, ref), np.abs(out - ref).max()
        assert {u.unit.gather_path for u in units} == {expect}, [u.unit.gather_path for u in units]
    widened_as_read(expect)
    # once gathered a shard is fixed: peers may be reading it at any moment
    st = units[1]
    try:
        st.unit.write(0, np.zeros(st.params[0].numel(), dtype=np.float32))
    except RuntimeError as e:
        assert "fixed" in str(e), e
    else:
        raise AssertionError("writing a gathered unit's shard was accepted")


def widened_as_read(expect: str) -> None:
    """A NumPy unit's direct gathers widen each chunk as they read it, where the first
    (collective) gather widens the whole gathered buffer: the same views, bit for bit, through
    the worker (start_unshard + wait) and synchronous (unshard). Slots of every kind, larger
    than the 128 KiB pieces, straddling the chunks; two units alike, so that each gathers into
    buffers the other just left (a byte not written would show). The bfloat16 model's forward
    matches its bfloat16-rounded reference."""
    from hsdp import _C

    rng = np.random.default_rng(7)
    group = hsdp.init_device_mesh("cpu", (1, hsdp.distributed.get_world_size())).shard_group
    kinds = [("bfloat16", "float32", (300_001,)), ("float32", "float32", (1001,)), ("float16", "float32", (70_003,)),
             ("int32", "int32", (517,)), ("bfloat16", "float32", (3,)), ("bfloat16", "bfloat16", (65_537,)),
             ("bfloat16", "float32", (5, 40_001))]
    units, wants = [], []
    for _ in range(2):
        values = [(rng.standard_normal(s) * 100).astype(np.int32 if d == "int32" else np.float32) for d, _, s in kinds]
        values[0][:4] = [np.inf, -np.inf, np.nan, -0.0]
        u = _C.Unit(group, [d for d, _, _ in kinds], [s for _, _, s in kinds], compute_dtypes=[c for _, c, _ in kinds])
        for i, v in enumerate(values):
            u.write(i, v)
        units.append(u)
        wants.append([(v if d == "int32" else _C.round_to(v, d)) for (d, _, _), v in zip(kinds, values)])

    def views(u, via_worker: bool) -> list[bytes]:
        if via_worker:
            u.start_unshard()
            u.wait()
        else:
            u.unshard()
        bufs = u.buffers()
        out = []
        for (which, off), (d, c, s) in zip(u.view_specs, kinds):
            item = np.dtype(np.uint16 if c in ("bfloat16", "float16") else c).itemsize
            out.append(bytes(memoryview(bufs[which])[off:off + item * int(np.prod(s))]))
        del bufs
        u.reshard()
        return out

    firsts = [views(u, False) for u in units]  # collective: sets the path
    for u, first, want in zip(units, firsts, wants):
        assert u.gather_path == expect, u.gather_path
        for i, ((d, c, s), w) in enumerate(zip(kinds, want)):
            w = _C.encode(w, "bfloat16").tobytes() if c == "bfloat16" else w.astype(c).tobytes()
            assert first[i] == w, (i, kinds[i])
    for via_worker in (True, False, True, True):
        for u, first in zip(units, firsts):
            assert views(u, via_worker) == first, via_worker

    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=3)
    ref = models.make_model("tiny", seed=0)
    for q in ref.parameters():
        q.data = _C.round_to(q.data, "bfloat16")
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="bfloat16"))
    for _ in range(3):
        assert np.array_equal(model(*x), ref(*x))


def scenario_late_peer(expect: str) -> None:
    """Rank 1 drops its model while rank 0 still reads it: the shards outlive the model until
    a collective shows no peer is behind; after that a read says the ranks are out of step."""
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=3)
    model = sharded()
    model(*x)  # every unit's first gather: collective, sets the path
    world = hsdp.distributed.get_world_size()
    rank = hsdp.distributed.get_rank()
    if rank == 1:
        del model
        gc.collect()  # the units are freed here, long before rank 0 reads them
    else:
        time.sleep(0.5)
        whole = models.make_model("tiny", seed=0)
        hsdp.unshard(model, recurse=True)
        for (n, p), (_, q) in zip(model.named_parameters(), whole.named_parameters()):
            assert np.array_equal(p.data, q.data), n
        hsdp.reshard(model, recurse=True)
    WORLD[0].barrier()  # every rank is past its reads: rank 1 releases its shards as this ends
    # rank 1 frees them once its own barrier completes, which rank 0's may outrun: a second
    # barrier, entered only after that, orders the release before rank 0's read
    WORLD[0].barrier()
    if rank != 1 and expect == "direct" and world == 2:
        try:
            hsdp.unshard(model, recurse=True)
        except RuntimeError as e:
            assert "out of step" in str(e) and "rank 1" in str(e), e
        else:
            raise AssertionError("reading a peer's released shard was accepted")
    print(f"rank {rank}: late peer ok", flush=True)


WORLD: list = []


def main() -> None:
    expect, name = sys.argv[1], sys.argv[2]
    WORLD.append(init_process_group())
    {"paths": scenario_paths, "late_peer": scenario_late_peer}[name](expect)
    print(f"rank {hsdp.distributed.get_rank()}: {name} ok", flush=True)


if __name__ == "__main__":
    main()
