"""One rank of the timeout check (started by tests/test_timeout.py under mpiexec): rank 1
stalls (or, with "kill", dies by SIGKILL) before the first forward; rank 0's first gather
must end the job, saying so, instead of waiting."""

from __future__ import annotations

import os
import signal
import sys
import time

import hsdp
from hsdp import models
from hsdp.distributed import init_process_group


def main() -> None:
    where = sys.argv[1]
    world = init_process_group()
    model = models.make_model("tiny", seed=0)
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))
    x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=3)
    print(f"rank {world.rank}: ready", flush=True)
    if world.rank == 1 and where == "elsewhere":
        world.barrier()  # a peer waiting in another collective than rank 0's gather
    if world.rank == 1 and where == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # a peer that dies without a word
    if world.rank == 1:
        time.sleep(120)  # a stalled peer: alive, never reaching the collective
    if where in ("forward", "kill", "elsewhere"):
        model(*x)
    else:
        world.barrier()
    print(f"rank {world.rank}: not reached", flush=True)


if __name__ == "__main__":
    main()
