"""Ranks of tests/test_hub.py: hsdp.hub.resolve_model_on_ranks inside a 2-rank job. argv: the
model text, then the case: "ok" (every rank prints the snapshot it resolved) or "missing"
(rank 0 cannot resolve: every rank raises the same HubError and prints it)."""

import sys

from hsdp.hub import HubError, resolve_model_on_ranks
from hsdp.world import distributed

world = distributed.init_process_group()
model, case = sys.argv[1], sys.argv[2]
try:
    folder = resolve_model_on_ranks(model, None, world)
    print(f"rank {world.rank} resolved {folder}", flush=True)
except HubError as exc:
    print(f"rank {world.rank} HubError: {exc}", flush=True)
