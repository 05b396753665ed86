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
    # once gathered a shard is fixed: peers may be reading it at any moment
    st = units[1]
    try:
        st.unit.write(0, np.zeros(st.params[0].numel(), dtype=np.float32))
    except RuntimeError as e:
        assert "fixed" in str(e), e
    else:
        raise AssertionError("writing a gathered unit's shard was accepted")


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
