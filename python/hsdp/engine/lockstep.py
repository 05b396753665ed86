"""Lockstep: the data-parallel lanes of one shard group gather the same units in the same order,
while each computes its own request (or nothing).

> **[Note: lockstep]** A unit's gather is a collective over its shard group, and with data
> parallelism (``DiffusionParallelConfig(data_parallel_size=D)``) the shard group spans lanes
> that run different requests: different prompts, step counts, guidance settings, experts,
> or none at all once a lane's batch has run out. Each sharded model's root forward starts
> with a *ballot*: every rank of the shard group says which model it is about to run (its
> index here, the same on every rank: models register in load order) or that it has nothing
> to run (IDLE), in one small all-gather. The ranks then agree, by the same rule on the same
> votes, on the one model the group runs now: among those wanted, the next after the last one
> run (round robin, so two lanes waiting for different experts take turns). The ranks that
> want it compute its forward as usual; every other rank *serves* it: it gathers every unit
> of that model in the order the computing ranks gather them (the recorded order; a model
> this rank never ran goes root first, then its units as registered) and gives each back at
> once, computing nothing, then votes again for what it wanted. A lane whose work is done
> calls :meth:`Lockstep.finish`, which serves until every rank votes IDLE. So the collectives
> of the group stay in one order on every rank whatever each lane computes, and a real
> desync (a rank that gathers another unit than its peers) still fails through the agreement
> tickets. Units whose gathers need no peer (direct gathers between ranks of one host, after
> their first) and units kept gathered (residency) are not served: there is nothing to join.
> A forward whose units depart from the recorded order is not served correctly: the tickets
> then fail it, naming the units (diffusion transformers run every step alike).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .schedule import Schedule

IDLE = -1


class Lockstep:
    """The ballot of one shard group's ranks over a set of models sharded over it (a
    pipeline's: :func:`hsdp.pipelines.lanes.install_lockstep`)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.schedules: list[Schedule] = []
        self._last = -1
        # counters, for tests and reports
        self.ballots = 0
        self.served_forwards = 0
        self.served_gathers = 0

    def register(self, schedule: Schedule) -> None:
        """A model sharded over this group: its index is its vote (every rank loads the same
        models in the same order, so the indices agree)."""
        if schedule.lockstep is self:
            return
        schedule.lockstep = self
        schedule.lockstep_id = len(self.schedules)
        self.schedules.append(schedule)

    # ---------------------------------------------------------------- the rule

    def _ballot(self, want: int) -> int:
        """Every rank's vote; the model the group runs now (IDLE: none is wanted)."""
        mine = np.array([want], dtype=np.int32)
        votes = np.empty(self.group.size, dtype=np.int32)
        self.group.all_gather(mine, votes)
        self.ballots += 1
        wanted = sorted({int(v) for v in votes if v != IDLE})
        bad = [v for v in wanted if not 0 <= v < len(self.schedules)]
        if bad:
            raise RuntimeError(
                f"lockstep: ranks of this shard group voted for model(s) {bad} that this rank did not load "
                f"({len(self.schedules)} sharded model(s) here): the ranks must load the same pipeline"
            )
        if not wanted:
            return IDLE
        pick = next((w for w in wanted if w > self._last), wanted[0])
        self._last = pick
        return pick

    # ---------------------------------------------------------------- entry points

    def enter(self, schedule: Schedule) -> None:
        """The root pre-forward of `schedule` on this rank: serve what the group runs first,
        until it is this model's turn (serving calls no hooks, so it never comes back here)."""
        while (pick := self._ballot(schedule.lockstep_id)) != schedule.lockstep_id:
            self._serve(pick)

    def finish(self) -> None:
        """This rank has nothing left to run: serve the others until every rank is done."""
        while (pick := self._ballot(IDLE)) != IDLE:
            self._serve(pick)

    def _serve(self, index: int) -> None:
        self.served_gathers += self.schedules[index].serve()
        self.served_forwards += 1

    def report(self) -> dict[str, int]:
        return {"models": len(self.schedules), "ballots": self.ballots, "served_forwards": self.served_forwards,
                "served_gathers": self.served_gathers}
