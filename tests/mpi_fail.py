"""A rank that raises while its peer waits in a collective (tests/test_multirank.py): the
job must end with an error, not hang."""

import sys

import hsdp

world = hsdp.distributed.init_process_group()
if world.rank == int(sys.argv[1]):
    raise RuntimeError(f"rank {world.rank} fails on purpose")
world.barrier()
print(f"rank {world.rank} passed a barrier its peer never reached", flush=True)
