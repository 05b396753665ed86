"""One rank of the timeout check (started by tests/test_timeout.py and tests/test_launch.py):
rank 1 stalls (or, with "kill", dies by SIGKILL) before the first forward; rank 0's first
gather must end the job, saying so, instead of waiting.

- "after": rank 1 stalls after a warm-up forward. Rank 0's second forward is served by
  direct reads and finishes alone (correct: the weights are static); its exit, MPI's end,
  which waits for every rank, must end the job instead of waiting.
- "stall": no model; rank 1 stalls and rank 0 waits in a barrier, for the launcher's tests
  of a job ended from outside.

"ready" lines carry the rank's pid and the shared-memory files it has mapped (its own
segment and its peer's), so a test can check that none is left running or left behind."""

from __future__ import annotations

import os
import signal
import sys
import time

from hsdp.world.distributed import init_process_group


def mapped_segments() -> list[str]:
    """Open MPI's shared-memory segment files this process maps (/proc/self/maps)."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        paths = {line.split(maxsplit=5)[5].strip() for line in f if line.count(" ") >= 5 and "vader_segment" in line}
    return sorted(p.removesuffix(" (deleted)") for p in paths)


def main() -> None:
    where = sys.argv[1]
    world = init_process_group()
    if where == "stall":
        world.barrier()  # every rank has mapped its peer's segment
    else:
        import hsdp
        from hsdp import models

        model = models.make_model("tiny", seed=0)
        hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32"))
        x = models.make_inputs(models.DiTConfig.preset("tiny"), seed=3)
        if where == "after":
            model(*x)  # the warm-up: every unit's first gather, after which gathers are direct
    print(f"rank {world.rank}: ready pid={os.getpid()} segments={','.join(mapped_segments())};", flush=True)
    if world.rank == 1 and where == "elsewhere":
        world.barrier()  # a peer waiting in another collective than rank 0's gather
    if world.rank == 1 and where == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # a peer that dies without a word
    if world.rank == 1:
        time.sleep(120)  # a stalled peer: alive, never reaching the collective
    if where in ("forward", "kill", "elsewhere"):
        model(*x)
    elif where == "after":
        model(*x)  # no peer needed
        print(f"rank {world.rank}: done", flush=True)
        return  # the exit meets the stalled peer
    else:
        world.barrier()
    print(f"rank {world.rank}: not reached", flush=True)


if __name__ == "__main__":
    main()
