"""One rank of the agreement checks (tests/test_agreement.py, under mpiexec).

`python tests/agreement_worker.py SCENARIO`; each rank writes what it saw, a line per
event, to $AGREEMENT_OUT/rank<r>.txt. A failure of the check itself raises out of main.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import hsdp
from hsdp import models
from hsdp.world.distributed import init_process_group


def sharded(seed: int = 0):
    model = models.make_model("tiny", seed=seed)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))
    return model


def report(rank: int, what: str) -> None:
    # one file per rank: lines through mpiexec's output can interleave mid-line
    with open(os.path.join(os.environ["AGREEMENT_OUT"], f"rank{rank}.txt"), "a") as f:
        f.write(what + "\n")


def scenario_equal(rank: int) -> None:
    """Rank r unshards blocks[r % 2]: two units of the same size. Every rank raises; none returns
    weights."""
    model = sharded()
    block = model.blocks[rank % 2]
    try:
        hsdp.unshard(block)
    except RuntimeError as exc:
        assert not hsdp.get_units(model)[rank % 2].unit.is_unsharded
        report(rank, f"RAISED {exc}")
        return
    report(rank, "RETURNED")


def scenario_unequal(rank: int) -> None:
    """Rank 0 unshards a block, the others the root unit (another size): all raise, no MPI
    truncation error."""
    model = sharded()
    try:
        hsdp.unshard(model.blocks[0] if rank == 0 else model, recurse=False)
    except RuntimeError as exc:
        report(rank, f"RAISED {exc}")
        return
    report(rank, "RETURNED")


def scenario_wire(rank: int) -> None:
    """Rank 0 shards with the float8 wire, the others without: a config that differs between
    ranks. Their gathers move different bytes, so every rank raises at the first; none
    returns bfloat16 bytes read as float8, or the reverse."""
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(
        enabled=True, wire_dtype="float8_e4m3fn" if rank == 0 else None))
    try:
        hsdp.unshard(model.blocks[0])
    except RuntimeError as exc:
        report(rank, f"RAISED {exc}")
        return
    report(rank, "RETURNED")


def scenario_twins(rank: int) -> None:
    """Two models of one architecture: rank 0 unshards the first one's blocks.0, the others
    the second one's. Same name, same size, same gather count: only the units' identity
    differs. Every rank raises; none returns weights mixed from the two models."""
    first, second = sharded(seed=0), sharded(seed=1)
    model = first if rank == 0 else second
    try:
        hsdp.unshard(model.blocks[0])
    except RuntimeError as exc:
        assert not hsdp.get_units(model)[0].unit.is_unsharded
        report(rank, f"RAISED {exc}")
        return
    report(rank, "RETURNED")


def scenario_caught(rank: int) -> None:
    """A serving loop: rank 1 fails inside block 0 of request 2 (4 blocks, so rank 0 gathers
    units rank 1 never asks for) and catches it; rank 0 does not. Every later request either
    raises on the ranks out of step or returns the exact result: never wrong numbers, never a
    hang."""
    cfg = models.DiTConfig.preset("small")
    x = models.make_inputs(cfg, seed=3)
    ref = models.make_model("small", seed=0)(*x)
    model = models.make_model("small", seed=0)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))
    inner = model.blocks[0].forward
    fail = {"now": False}

    def flaky(*args, **kwargs):
        if fail["now"]:
            fail["now"] = False
            raise ValueError("a per-request failure on this rank")
        return inner(*args, **kwargs)

    model.blocks[0].forward = flaky
    # each rank serves until three requests in a row came back after the failure (at most 10)
    streak, request = 0, 0
    while streak < 3 and request < 10:
        fail["now"] = rank == 1 and request == 2
        try:
            out = model(*x)
        except (RuntimeError, ValueError) as exc:
            report(rank, f"request {request} RAISED {type(exc).__name__}: {str(exc)[:160]}")
            streak = 0
        else:
            exact = bool(np.array_equal(out, ref))
            report(rank, f"request {request} {'EXACT' if exact else 'WRONG'}")
            streak = streak + 1 if request >= 2 else 0
        request += 1


def main() -> None:
    world = init_process_group()
    if os.environ.get("AGREEMENT_MODE") == "separate":  # the tickets' own round trip, not beside the data
        hsdp._C._set_agreement_check("separate")
    globals()[f"scenario_{sys.argv[1]}"](world.rank)


if __name__ == "__main__":
    main()
