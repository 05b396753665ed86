"""A residency budget: up to N bytes per rank of units stay gathered across forwards, the
rest gather every forward (``HSDPInferenceConfig(resident_bytes=N | "auto")``).

The rule (which units stay), applied once the first forward has recorded the unit order:

1. Every unit gathers once per forward, so a resident unit saves one gather per forward.
   A gather costs about ``latency + bytes / bandwidth``; per resident byte that saves
   ``1 / bandwidth + latency / bytes``: the bandwidth part is the same for every unit, the
   latency part favours small units.
2. Prefetch hides a gather behind the compute of the unit before it, except for the first
   units of a forward: the root gathers before anything runs, and the first unit it calls
   gathers behind only the root's own code before that call (embeddings, a few
   milliseconds). Their gathers are exposed, so keeping them saves their whole time.

So: the exposed units first (the root, then the first unit in forward order; with
``prefetch_depth=0`` every gather is exposed and this step adds nothing), then the rest by
size, smallest first, ties in forward order (a resident prefix of blocks also gives the
first gathered block the whole prefix's compute to hide behind). Each unit is taken if it
still fits in the budget, else skipped. A unit's bytes are its full (unsharded) buffers,
as ``memory_stats()["unsharded_bytes"]`` counts them.

Every rank of a shard group must skip the same gathers, so the budget is agreed on: one
small all-gather over the shard group at the end of the first forward. Explicit budgets
that differ between ranks are an error on every rank; ``"auto"`` takes the smallest
rank's value. The choice then depends only on the recorded order and the unit sizes,
which are the same on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import _C

if TYPE_CHECKING:
    from .units import UnitState

log = logging.getLogger("hsdp")

RULE = ("exposed first (the root, then the first unit of the forward), then smallest first, "
        "ties in forward order; each unit kept if it still fits the budget")

# "auto" keeps this share of the free memory (and at least AUTO_MIN_MARGIN bytes) free for
# activations, the pool of the units that still gather, and everything else the process
# allocates later.
AUTO_MARGIN = 0.20
AUTO_MIN_MARGIN = 1 << 30

def mem_available(path: str = "/proc/meminfo") -> int:
    """The host's MemAvailable in bytes."""
    with open(path) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"{path} has no MemAvailable line; pass resident_bytes as a number")


def free_bytes(device: str) -> int:
    """Free memory this rank may use on ``device`` (a unit's: 'host' or its group's device):
    the device's own free bytes where its device table can say (NCCL: cudaMemGetInfo, which
    torch.cuda.mem_get_info reads too; no framework is asked), else the host's MemAvailable
    divided among the ranks on this host (the host, and a device whose memory is the host's:
    the test-only fakedev, NCCL over the test fake's host view)."""
    from ..world import devices, job

    on_device = _C.device_free_bytes(device) if devices.framework_of(device) != devices.host_framework() else None
    if on_device is not None:
        return int(on_device)
    return mem_available() // job.local_size()  # ranks on a host share one MemAvailable


def auto_budget(device: str) -> int:
    """``"auto"`` for this rank: the free memory less the margin (AUTO_MARGIN of it, at least
    AUTO_MIN_MARGIN), never negative."""
    free = free_bytes(device)
    return max(0, free - max(int(free * AUTO_MARGIN), AUTO_MIN_MARGIN))


def agree(group: Any, budget: int, is_auto: bool) -> int:
    """The budget every rank of `group` uses: equal explicit budgets, or the smallest auto
    one. A rank whose explicit budget differs, or that could not resolve "auto" (budget -1),
    makes every rank raise."""
    import numpy as np

    if group is None or group.size == 1:
        return budget
    send = np.array([budget, int(is_auto)], dtype=np.int64)
    recv = np.zeros((group.size, 2), dtype=np.int64)
    group.all_gather(send, recv)  # host arrays on every backend (NCCL stages them through its device)
    failed = [r for r in range(group.size) if recv[r, 0] < 0]
    if failed:
        raise RuntimeError(f"resident_bytes='auto': rank(s) {failed} of the shard group could not read their free "
                           "memory; pass resident_bytes as a number")
    if recv[:, 1].any():
        if not recv[:, 1].all():
            raise ValueError("resident_bytes: some ranks of the shard group asked for 'auto' and others for a number "
                             f"(per rank: {[int(b) if not a else 'auto' for b, a in recv]}); every rank must pass "
                             "the same resident_bytes")
        return int(recv[:, 0].min())
    if len(set(recv[:, 0].tolist())) != 1:
        raise ValueError(f"resident_bytes differs between the ranks of the shard group ({recv[:, 0].tolist()}); "
                         "every rank must skip the same gathers, so pass the same resident_bytes on every rank")
    return budget


def choose(order: Sequence[UnitState], budget: int, depth: int) -> list[UnitState]:
    """The units to keep gathered under `budget` bytes, by the module's rule (see RULE)."""
    units = list({id(u): u for u in order}.values())  # a unit called twice counts once
    n_exposed = 2 if depth > 0 else 0
    rest = sorted(range(n_exposed, len(units)), key=lambda i: (units[i].full_bytes, i))
    chosen: list[UnitState] = []
    left = budget
    for u in [*units[:n_exposed], *(units[i] for i in rest)]:
        if u.full_bytes <= left:
            chosen.append(u)
            left -= u.full_bytes
    return chosen
